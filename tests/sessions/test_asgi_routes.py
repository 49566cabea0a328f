"""The session server's routes (sessions/asgi.py) reach the server only through
``SessionRoutes``: a small fake serves them, and the real server answers ``/v1/models``
for open sessions only."""

from __future__ import annotations

from typing import Any

import httpx
from fake_engines import FixedReplyEngine
from starlette.testclient import TestClient

from rltool.sessions import SessionServer
from rltool.sessions.asgi import SessionRoutes, build_app
from rltool.sessions.guard import SessionSlots
from rltool.sessions.protocol import ApiError


class TwoRoutes:
    """A SessionRoutes with one open session, ``a``; records the chat bodies."""

    def __init__(self) -> None:
        self.bodies: list[Any] = []

    def authorize(self, session_id: str, token: str) -> None:
        self._check(session_id)
        if token != "t":
            raise ApiError(403, "wrong token", "permission_denied")

    def _check(self, session_id: str) -> None:
        if session_id != "a":
            raise ApiError(404, f"session {session_id!r} is not open", "not_found")

    def models(self, session_id: str) -> dict[str, Any]:
        self._check(session_id)
        return {"object": "list", "data": [{"id": "fake"}]}

    async def chat(self, session_id: str, body: Any) -> dict[str, Any]:
        self._check(session_id)
        self.bodies.append(body)
        return {"id": "chat-1", "choices": []}


def test_the_routes_need_only_the_protocol():
    routes = TwoRoutes()
    server: SessionRoutes = routes  # checked by the type checker, exercised below
    client = TestClient(build_app(server, 1024, api_key="k", slots=SessionSlots(2)))
    auth = {"Authorization": "Bearer k"}
    assert client.get("/s/a/t/v1/models", headers=auth).json()["data"] == [{"id": "fake"}]
    missing = client.get("/s/b/t/v1/models", headers=auth)
    assert missing.status_code == 404 and "'b' is not open" in missing.json()["error"]["message"]
    chat = client.post("/s/a/t/v1/chat/completions", json={"messages": []}, headers=auth)
    assert chat.json() == {"id": "chat-1", "choices": []}
    wrong = client.post("/s/a/x/v1/chat/completions", json={"messages": [1]}, headers=auth)
    assert wrong.status_code == 403
    tokenless = client.post("/s/a/v1/chat/completions", json={"messages": [2]}, headers=auth)
    assert tokenless.status_code == 404 and "<token>" in tokenless.json()["error"]["message"]
    assert routes.bodies == [{"messages": []}]
    assert client.get("/s/a/t/v1/models").status_code == 401  # no key


def test_models_answers_for_open_sessions_only(tokenizer):
    with SessionServer(FixedReplyEngine(tokenizer), tokenizer) as server:
        server.open_session("s1")
        url = server.base_url("s1")
        listed = httpx.get(url + "/models", timeout=30)
        assert listed.status_code == 200
        assert [m["id"] for m in listed.json()["data"]] == [server.model_name]
        server.close_session("s1")
        gone = httpx.get(url + "/models", timeout=30)
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found"
