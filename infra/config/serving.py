"""The sections of what serves the model: the dev model server ([server]) and the LLM proxy in front of it ([proxy])."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentstream.infra.config.checks import Checks


@dataclass(frozen=True)
class ServerConfig:
    """The dev model server (``agentstream serve-model``): where it runs, at what precision, under which contract.

    ``device`` and ``dtype`` follow the trainer's rule (``auto``: CUDA with bfloat16 autocast
    over float32 weights when present, else float32 on the CPU), so on one machine the server's
    behaviour logprobs and the trainer's recomputed ones agree. ``threads`` applies on the CPU only.
    ``contract`` is ``dev`` (vLLM's API plus ``X-Policy-Version`` and ``/v1/load_weights``) or
    ``vllm`` (exactly what vLLM >= 0.10.2 answers: no policy versions, LoRA updates only).
    """

    device: str = "auto"
    dtype: str = "auto"
    threads: int = 2
    contract: str = "dev"
    max_tokens: int = 1024  # a chat request that names no max_tokens generates at most this many (0: up to the context)

    def __post_init__(self) -> None:
        check = Checks("server", self)
        check.at_least("max_tokens", 0, " (0: no default limit)")
        check.device("device")
        check.one_of("dtype", ("auto", "float32", "bfloat16"))
        check.at_least("threads", 0)
        check.one_of("contract", ("dev", "vllm"))


def server_urls_problem(urls: Sequence[str]) -> str | None:
    """What is wrong with a list of model server URLs (one not http:// or https://, one named twice), or None."""
    if wrong := [url for url in urls if not url.startswith(("http://", "https://"))]:
        return f"not an http:// or https:// URL: {', '.join(wrong)}"
    bases = [url.rstrip("/").removesuffix("/v1") for url in urls]
    if twice := sorted({base for base in bases if bases.count(base) > 1}):
        return f"a model server named twice: {', '.join(twice)}"
    return None


@dataclass(frozen=True)
class ProxyConfig:
    """The LLM proxy: ``max_tokens`` is added to a generation request that names none (0: leave it to the server).

    ``upstreams``: the model servers it forwards to when ``agentstream proxy`` names none with
    ``--upstream`` (``AGENTSTREAM_PROXY_UPSTREAMS``, comma-separated). Each is asked ``/health`` and
    ``/v1/models`` every ``health_interval_s`` (each call bounded by ``health_timeout_s``);
    ``eject_after`` failures in a row take one out until a health check passes.
    """

    max_tokens: int = 1024
    upstreams: tuple[str, ...] = ()
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    eject_after: int = 3

    def __post_init__(self) -> None:
        check = Checks("proxy", self)
        check.at_least("max_tokens", 0, " (0: no default limit)")
        problem = server_urls_problem(self.upstreams)
        check.that(problem is None, f"upstreams: {problem}")
        check.above("health_interval_s", 0)
        check.above("health_timeout_s", 0)
        check.at_least("eject_after", 1)
