"""The daemon's FastAPI app: a factory plus a lifespan that starts and stops the deployment manager."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from depctl import __version__
from depctl.settings import Settings
from depctl.store import SpecStore
from depctl_runtime.api.errors import install_handlers
from depctl_runtime.api.guard import Guard
from depctl_runtime.api.metrics import Metrics
from depctl_runtime.api.routes import router
from depctl_runtime.api.serving import Service
from depctl_runtime.manager import DeploymentManager


def create_app(
    store: SpecStore | None = None, manager: DeploymentManager | None = None, settings: Settings | None = None
) -> FastAPI:
    settings = settings or Settings()
    manager = manager or DeploymentManager(store or SpecStore(), load_timeout=settings.load_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        manager.start()
        try:
            yield
        finally:
            manager.stop()

    app = FastAPI(title="depctl runtime", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.manager = manager
    app.state.metrics = Metrics(manager)
    app.state.service = Service(manager, app.state.metrics, settings)
    install_handlers(app)
    app.include_router(router)
    app.add_middleware(Guard, settings=settings)
    return app
