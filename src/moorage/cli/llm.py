"""``moorage llm ...``: talk to the configured model provider from the terminal.

``chat`` runs one call through the gateway (with accounting printed); ``providers`` lists what is available.
"""

from __future__ import annotations

import asyncio
import json
from typing import Optional

import typer
from rich.console import Console

from moorage.cli.console import make_console

app = typer.Typer(no_args_is_help=True, help="Call the configured LLM provider (embedded llama.cpp, OpenAI-compatible, Anthropic).")
console = make_console()


def _cfg():  # type: ignore[no-untyped-def]
    from moorage.cli.main import state

    return state.cfg


@app.command()
def providers(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """List the provider kinds, their capabilities, and which one is configured."""
    from moorage.llm import AnthropicProvider, EmbeddedProvider, OpenAICompatibleProvider
    from moorage.llm.factory import PROVIDERS

    cfg = _cfg()
    caps = {"embedded": EmbeddedProvider.capabilities, "openai": OpenAICompatibleProvider.capabilities, "anthropic": AnthropicProvider.capabilities}
    rows = [
        {"name": n, "configured": n == cfg.llm_provider, "exact_token_count": caps[n].exact_token_count,
         "streaming": caps[n].streaming, "tools": caps[n].tools, "json_schema": caps[n].json_schema,
         # The configured one's model and base URL (the text's last line); null for the others, or the default.
         "model": (cfg.llm_model or None) if n == cfg.llm_provider else None,
         "base_url": (cfg.llm_base_url or None) if n == cfg.llm_provider else None}
        for n in PROVIDERS
    ]
    if as_json:
        print(json.dumps({"data": rows}, indent=2))
        return
    for r in rows:
        mark = "[green]*[/]" if r["configured"] else " "
        counting = "exact token count" if r["exact_token_count"] else "estimated token count"
        console.print(f"{mark} {r['name']:<10} streaming, tools, json-schema; {counting}", highlight=False)
    console.print(f"[dim]configured: llm_provider={cfg.llm_provider} model={cfg.llm_model or '(default)'} base_url={cfg.llm_base_url or '(default)'}[/]", highlight=False)


@app.command()
def chat(
    prompt: str = typer.Argument(..., help="What to ask."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1, help="Most tokens to generate."),
    temperature: Optional[float] = typer.Option(None, "--temperature",
                                                help="Sampling temperature (default: the provider's)."),
    stream: bool = typer.Option(False, "--stream", help="Print the answer as it is generated."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole response and its usage as JSON."),
) -> None:
    """Ask the configured provider one question (through the gateway, with retries and accounting)."""
    from moorage.llm import ChatRequest, InMemoryUsageSink, Message, gateway_from_config

    messages = ([Message.system(system)] if system else []) + [Message.user(prompt)]
    request = ChatRequest(messages, max_tokens=max_tokens, temperature=temperature)
    sink = InMemoryUsageSink()

    async def run() -> None:
        gateway = gateway_from_config(_cfg(), usage_sink=sink)
        try:
            if stream and not as_json:
                async for chunk in gateway.stream("cli", request):
                    print(chunk.text, end="", flush=True)
                print()
            else:
                r = await gateway.complete("cli", request)
                if as_json:
                    rec = sink.records[-1]
                    print(json.dumps({"text": r.text, "finish_reason": r.finish_reason, "model": r.model, "provider": r.provider,
                                      "usage": {"input_tokens": rec.input_tokens, "output_tokens": rec.output_tokens,
                                                "cached_input_tokens": rec.cached_input_tokens},
                                      "cost_usd": rec.cost_usd, "latency_ms": rec.latency_ms}, indent=2))
                else:
                    print(r.text)
        finally:
            await gateway.aclose()

    asyncio.run(run())
    if not as_json and sink.records:
        rec = sink.records[-1]
        Console(stderr=True).print(
            f"[dim]{rec.provider}/{rec.model}: {rec.input_tokens} in ({rec.cached_input_tokens} cached), "
            f"{rec.output_tokens} out, {rec.latency_ms:.0f} ms[/]", highlight=False)
