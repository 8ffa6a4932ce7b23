"""The LangGraph server as its production image runs it, for the benchmarks.

Run with the LangGraph virtualenv's Python in a directory holding ``langgraph.json``:
``python bench/langgraph_production.py HOST PORT``. It serves ``langgraph_api.server:app``
under uvicorn with the configuration ``langgraph dev`` would pass (graphs, auth, http,
the in-memory runtime) but none of what ``langgraph dev`` adds for development: no
private-network CORS middleware (``ALLOW_PRIVATE_NETWORK``, a ``BaseHTTPMiddleware``
in front of every request), not the ``local_dev`` variant, and JSON logs
(``LOG_JSON=true``, as the hosted platform sets) in place of colored console logs.
The runtime stays the in-memory one (the production image's PostgreSQL runtime is not
public).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    config = json.loads(Path("langgraph.json").read_text())
    cwd = Path.cwd()
    sys.path.append(str(cwd))
    for dep in config.get("dependencies", []):
        if (cwd / dep).is_dir():
            sys.path.append(str(cwd / dep))

    def dumped(key: str) -> str | None:
        return json.dumps(config[key]) if config.get(key) else None

    settings = {
        "MIGRATIONS_PATH": "__inmem",
        "DATABASE_URI": ":memory:",
        "REDIS_URI": "fake",
        "N_JOBS_PER_WORKER": "1",
        "LANGSERVE_GRAPHS": dumped("graphs"),
        "LANGGRAPH_AUTH": dumped("auth"),
        "LANGGRAPH_HTTP": dumped("http"),
        "LANGGRAPH_STORE": dumped("store"),
        "LANGGRAPH_API_URL": f"http://{host}:{port}",
        "LANGGRAPH_RUNTIME_EDITION": "inmem",
        "LANGGRAPH_ALLOW_BLOCKING": "true",
        "LANGGRAPH_DISABLE_FILE_PERSISTENCE": "false",
        "LOG_JSON": "true",
    }
    os.environ.update({k: v for k, v in settings.items() if v is not None})
    for dev_only in ("ALLOW_PRIVATE_NETWORK", "LANGSMITH_LANGGRAPH_API_VARIANT"):
        os.environ.pop(dev_only, None)

    import uvicorn

    uvicorn.run(
        "langgraph_api.server:app",
        host=host,
        port=port,
        access_log=False,  # the server's own access log (JSON) stays on
        log_config={
            "version": 1,
            "incremental": False,
            "disable_existing_loggers": False,
            "formatters": {"json": {"class": "langgraph_api.logging.Formatter"}},
            "handlers": {
                "console": {
                    "class": "logging.StreamHandler",
                    "formatter": "json",
                    "stream": "ext://sys.stdout",
                }
            },
            "loggers": {
                "uvicorn": {"level": "WARNING"},
                "uvicorn.error": {"level": "WARNING"},
                "langgraph_api.server": {"level": "WARNING"},
            },
            "root": {"handlers": ["console"]},
        },
    )


if __name__ == "__main__":
    main()
