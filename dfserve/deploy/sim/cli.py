"""`dfserve sim`: serve the simulated SGLang engine (flags shaped like SGLang's launch_server where they overlap)."""

from __future__ import annotations

import click
from pydantic import ValidationError

from dfserve.deploy.sim.config import SimConfig
from dfserve.deploy.sim.faults import FaultConfig
from dfserve.errors import command_flags, flags_for, invalid_field
from dfserve.flags import FINITE


def build_config(**values: object) -> SimConfig:
    fault_keys = ("error_rate", "stall_fraction", "stall_s", "disconnect_fraction", "abort_fraction",
                  "backlog_fraction")
    faults = {k: values.pop(k) for k in fault_keys}
    try:
        return SimConfig.model_validate({**values, "faults": FaultConfig.model_validate(faults)})
    except ValidationError as exc:
        raise invalid_field(exc) from None


@click.command(context_settings={"show_default": True})
@click.option("--host", default="127.0.0.1", help="Address to listen on.")
@click.option("--port", type=int, default=30000, help="Listen port; 0 takes a free one (the log line says which).")
@click.option("--profile", default="zlab", help="Drafter profile: zlab, inhouse, none (no speculation), or FILE.json.")
@click.option("--time-scale", type=FINITE, default=1.0, help="Multiplies every modelled time (0.02: 50x faster).")
@click.option("--seed", type=int, default=0, help="Seeds acceptance draws, jitter and faults.")
@click.option("--max-running-requests", type=int, default=48, help="Requests decoded at once; the rest queue.")
@click.option("--max-prefill-tokens", type=int, default=16384, help="Prompt tokens one prefill step admits.")
@click.option("--context-length", type=int, default=262144)
@click.option("--served-model-name", default=None, help="Model name in responses and /v1/models [model path].")
@click.option("--model-path", default="Qwen/Qwen3.6-27B", help="Target model reported in /server_info.")
@click.option("--draft-model-path", default=None, help="Drafter reported in /server_info [from the profile].")
@click.option("--block-size", type=int, default=None, help="Verify block size [the profile's, 16].")
@click.option("--incremental-streaming-output", is_flag=True, help="Stream text and ids as deltas, like SGLang's flag.")
@click.option("--record-chunk-times", is_flag=True,
              help="Put each chunk's send and modelled due time into a stream's final native meta_info "
                   "(OpenAI streams: an SSE comment before [DONE]).")
@click.option("--api-key", default=None,
              help="Like SGLang's --api-key: every route but health, readiness and metrics needs Authorization: Bearer KEY.")
@click.option("--spec-details/--no-spec-details", default=True,
              help="Answer return_spec_tokens_details (SGLang 0.5.23); off: ignore it, as earlier SGLang does.")
@click.option("--lossy-fraction", type=FINITE, default=0.0, help="Fraction of prompts whose output text differs.")
@click.option("--error-rate", type=FINITE, default=0.0, help="Fraction of requests answered with HTTP 500.")
@click.option("--stall-fraction", type=FINITE, default=0.0, help="Fraction of requests that stall mid-stream.")
@click.option("--stall-s", type=FINITE, default=5.0, help="Length of a stall, seconds at time scale 1.")
@click.option("--disconnect-fraction", type=FINITE, default=0.0, help="Fraction of requests dropped mid-stream.")
@click.option("--abort-fraction", type=FINITE, default=0.0,
              help="Fraction of requests the engine aborts mid-stream with status 503 (in band in a 200 stream).")
@click.option("--backlog-fraction", type=FINITE, default=0.0,
              help="Fraction of streams whose client falls behind: one chunk then carries several verify rounds.")
def sim(**values: object) -> None:
    """Serve the simulated SGLang engine: SGLang's HTTP API with modelled acceptance and latency."""
    from dfserve.deploy.sim.server import run

    with flags_for(command_flags(sim)):
        run(build_config(**values))
