"""Session server: OpenAI-compatible chat endpoint that records agent sessions token-exactly."""

from rltool.sessions.export import export
from rltool.sessions.server import SessionServer
from rltool.sessions.session import Segment, Session
from rltool.sessions.tool_calls import TOOL_CHAT_TEMPLATE, parse_reply

__all__ = ["TOOL_CHAT_TEMPLATE", "Segment", "Session", "SessionServer", "export", "parse_reply"]
