"""Validate an SGLang argv with SGLang's own code; run by path under SGLang's interpreter (imports no dfserve).

Reads `{"argv": [...]}` on stdin and prints one JSON line
`{"ok": bool, "version": str, "problems": [...], "resolved": {...}}` after the marker below. Checks, all with SGLang's code:
`prepare_server_args` parses the argv; `SpeculativeAlgorithm.from_string` knows the algorithm and it is DFLASH;
`_handle_dflash` (the rules `ServerArgs` applies at launch) passes for the argv's `--device` (CUDA when unset, as on
every GPU host profile); and the draft attention backend is kept rather than replaced by a fallback. (The drafter's config.json is
checked by dfserve itself: SGLang's DFlash config parser imports its model layers, which need GPU-only packages.)

    python dfserve/deploy/sglang_check.py < request.json
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from typing import Any

MARKER = "DFSERVE-SGLANG-CHECK "


def check(request: dict[str, Any]) -> dict[str, Any]:
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.arg_groups.overrides import declare_resolution
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.version import __version__

    problems: list[str] = []
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = prepare_server_args(list(request["argv"]))
    except SystemExit:
        lines = [line for line in errors.getvalue().splitlines() if line.strip()]
        problem = lines[-1] if lines else "SGLang's parser rejected the argv"
        return {"ok": False, "version": __version__, "problems": [problem], "resolved": {}}
    try:
        algorithm = SpeculativeAlgorithm.from_string(args.speculative_algorithm)
        if not algorithm.is_dflash():
            problems.append(f"speculative algorithm is {algorithm.name}, not DFLASH")
    except ValueError as exc:
        problems.append(f"--speculative-algorithm: {exc}")
    requested_backend = args.speculative_draft_attention_backend
    resolved: dict[str, Any] = {}
    try:
        declare_resolution(args, "dfserve --check", device=args.device or "cuda")
        _handle_dflash(args)
        view = resolved_view(args)
        resolved = {
            key: getattr(view, key)
            for key in ("speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
                        "speculative_draft_attention_backend", "max_running_requests", "speculative_draft_model_path")
        }
        if requested_backend and resolved["speculative_draft_attention_backend"] != requested_backend:
            problems.append(
                f"--speculative-draft-attention-backend {requested_backend} is not supported by DFLASH; "
                f"SGLang would fall back to {resolved['speculative_draft_attention_backend']}"
            )
    except ValueError as exc:
        problems.append(f"DFLASH: {exc}")
    return {"ok": not problems, "version": __version__, "problems": problems, "resolved": resolved}


def main() -> None:
    result = check(json.loads(sys.stdin.read()))
    sys.stdout.write(MARKER + json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
