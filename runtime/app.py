"""The daemon's FastAPI app: a factory plus a lifespan that starts and stops the deployment manager."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from depctl import __version__
from depctl.store import SpecStore
from runtime.api.errors import install_handlers
from runtime.api.metrics import Metrics
from runtime.api.routes import router
from runtime.api.serving import Service
from runtime.manager import DeploymentManager


def create_app(store: SpecStore | None = None, manager: DeploymentManager | None = None) -> FastAPI:
    manager = manager or DeploymentManager(store or SpecStore())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        manager.start()
        try:
            yield
        finally:
            manager.stop()

    app = FastAPI(title="depctl runtime", version=__version__, lifespan=lifespan)
    app.state.manager = manager
    app.state.metrics = Metrics(manager)
    app.state.service = Service(manager, app.state.metrics)
    install_handlers(app)
    app.include_router(router)
    return app
