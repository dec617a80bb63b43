"""Exceptions a route handler did not expect are answered there (OpenAI-shaped 500) and never
reach Starlette's server-error layer, which would re-raise them: the client's keep-alive
connection would be closed and the server log would show an unhandled exception."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from vllm.entrypoints.openai.errors import BadRequestError, OpenAIRoute, install_error_handlers


class Body(BaseModel):
    n: int


def _app() -> FastAPI:
    router = APIRouter(route_class=OpenAIRoute)

    @router.post("/boom")
    async def boom(body: Body) -> dict:
        if body.n == 0:
            raise RuntimeError("a bug in serving code")
        if body.n == 1:
            raise BadRequestError("n must not be 1", param="n")
        return {"n": body.n}

    app = FastAPI()
    app.include_router(router)
    install_error_handlers(app)
    return app


def test_unexpected_exception_is_an_openai_500_and_not_re_raised():
    # raise_server_exceptions=True: a re-raised exception would surface here.
    with TestClient(_app(), raise_server_exceptions=True) as client:
        response = client.post("/boom", json={"n": 0})
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "InternalServerError" and error["code"] == 500
        assert "a bug in serving code" in error["message"]
        assert client.post("/boom", json={"n": 2}).json() == {"n": 2}


def test_known_errors_keep_their_status():
    with TestClient(_app(), raise_server_exceptions=True) as client:
        bad = client.post("/boom", json={"n": 1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
        invalid = client.post("/boom", json={"n": "x"})
        assert invalid.status_code == 400 and invalid.json()["error"]["type"] == "BadRequestError"
