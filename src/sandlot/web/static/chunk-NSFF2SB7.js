import{a,b,c,d}from"./chunk-VM5VXNQ6.js";import"./chunk-VXCIUV64.js";import"./chunk-CVABY6ML.js";export{d as css,b as cssCompletionSource,c as cssLanguage,a as defineCSSCompletionSource};
