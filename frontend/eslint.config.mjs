// The page's lint rules: typescript-eslint's type-checked set, and no way to turn data into markup.
import js from "@eslint/js";
import tseslint from "typescript-eslint";

export default tseslint.config(
  { ignores: ["node_modules/", "build.mjs", "eslint.config.mjs"] },
  js.configs.recommended,
  ...tseslint.configs.recommendedTypeChecked,
  {
    languageOptions: {
      parserOptions: { projectService: true, tsconfigRootDir: import.meta.dirname },
    },
    rules: {
      "no-restricted-properties": [
        "error",
        { property: "innerHTML", message: "render data with textContent" },
        { property: "outerHTML", message: "render data with textContent" },
        { property: "insertAdjacentHTML", message: "render data with textContent" },
      ],
      "no-restricted-syntax": [
        "error",
        { selector: "CallExpression[callee.name='eval']", message: "no eval" },
        { selector: "NewExpression[callee.name='Function']", message: "no eval" },
      ],
      "@typescript-eslint/no-floating-promises": "error",
      "@typescript-eslint/no-unused-vars": ["error", { argsIgnorePattern: "^_" }],
    },
  },
);
