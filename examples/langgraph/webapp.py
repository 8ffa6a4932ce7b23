"""Sandlot's control plane, dataplane and MCP server inside this LangGraph server.

Settings come from ``SANDLOT_*`` variables (``SANDLOT_DATA_DIR``, ``SANDLOT_CONFIG``…);
the URL clients reach sandlot at is the LangGraph server's own.
"""

from sandlot.integrations.langgraph import create_app

app = create_app()
