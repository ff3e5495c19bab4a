"""A shadow record folder's arms as their engines described themselves when it was opened (config.json's
`/server_info`s): whether a candidate may be judged against the primary, and a secondary serve as the noise floor.
Read by `dfserve compare` and by the gateway's live decision, which must refuse what compare would."""

from __future__ import annotations

from dfserve.baselines import one_drafter
from dfserve.gateway.config import endpoint
from dfserve.sglang import ServerInfo, parse_server_info
from dfserve.shadow.recorder import ShadowRunConfig
from dfserve.verdict.wording import differences


def server(config: ShadowRunConfig, arm: str) -> ServerInfo | None:
    info = config.arms.get(arm)
    return parse_server_info(info.server_info) if info is not None and info.server_info is not None else None


def _known(config: ShadowRunConfig, arms: tuple[str, str]) -> tuple[ServerInfo, ServerInfo] | list[str]:
    """Both arms' engines, or a line for each arm whose engine is unknown."""
    servers = [server(config, arm) for arm in arms]
    if servers[0] is None or servers[1] is None:
        return [f"arm {arm}: its /server_info was not recorded, so its target and drafter are unknown"
                for arm, found in zip(arms, servers, strict=True) if found is None]
    return servers[0], servers[1]


def _engines_differ(base: ServerInfo, other: ServerInfo) -> list[str]:
    return [line for field in ("model_path", "max_running_requests")
            for line in differences(f"server {field}", getattr(base, field), getattr(other, field))]


def mismatches(config: ShadowRunConfig, base: str, cand: str) -> list[str]:
    """What differs between two arms' engines beyond the drafter, and the drafter when it does not; an arm whose
    engine is unknown is one."""
    known = _known(config, (base, cand))
    if isinstance(known, list):
        return known
    return [*_engines_differ(*known),
            *one_drafter(known[0].draft_model_path or "none", known[1].draft_model_path or "none")]


def floor_mismatches(config: ShadowRunConfig, primary: str, secondary: str) -> list[str]:
    """Why `secondary` is no noise floor for `primary`: it must run the primary's target and drafter, on an engine
    of its own (on the primary's, its figures are the primary's, and a floor of zero width passes anything)."""
    known = _known(config, (primary, secondary))
    if isinstance(known, list):
        return known
    problems = _engines_differ(*known)
    drafters = [s.draft_model_path or "none" for s in known]
    if not one_drafter(*drafters):
        problems.append(f"noise floor {secondary} serves drafter {drafters[1]!r}, not the primary's {drafters[0]!r}")
    urls = [config.arms[arm].url for arm in (primary, secondary)]
    if endpoint(urls[0]) == endpoint(urls[1]):
        problems.append(f"noise floor {secondary} is the primary's own engine ({urls[0]}): its figures are the "
                        "primary's")
    return problems
