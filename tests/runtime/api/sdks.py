"""Both SDKs against a daemon's app in process (an ASGI transport): the ``app`` fixture (conftest.py) serves tiny
deployments under every speculation method and one whose chat template takes tools."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import openai

METHODS = ("plain", "ngram", "suffix", "drafted")


def run(app, scenario):
    """``scenario(anthropic_client, openai_client, httpx_client)`` on one event loop, all talking to ``app``."""

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=120) as http:
            claude = anthropic.AsyncAnthropic(base_url="http://127.0.0.1", api_key="k", http_client=http, max_retries=0)
            oai = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="k", http_client=http, max_retries=0)
            return await scenario(claude, oai, http)

    return asyncio.run(go())
