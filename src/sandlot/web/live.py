"""The web app's live routes, as ``sandlot serve`` and ``sandlot web`` serve them: the
shared terminals (``/ws/pty``, ``/api/sessions``) and the chat (``/ws/claude-stream``),
under one socket budget, its limits the settings' ``socket_limits``."""

from __future__ import annotations

from starlette.routing import BaseRoute

from sandlot.web.chat import chat_routes
from sandlot.web.chat_templates import load_chat_templates
from sandlot.web.limits import SocketGate
from sandlot.web.settings import WebSettings
from sandlot.web.terminals import terminal_routes


def live_routes(settings: WebSettings) -> list[BaseRoute]:
    """For ``create_web_app(extra_routes=…)``: they find the app's gateway, auth and
    workspaces at their first request; connects are counted across both."""
    gate = SocketGate(settings.socket_limits)
    templates = load_chat_templates(settings.chat_templates_file)
    return [*terminal_routes(limits=gate), *chat_routes(limits=gate, templates=templates)]
