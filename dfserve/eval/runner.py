"""One offline evaluation from start to end: verify every asset, make or reuse the references and the target
features, score each drafter at every anchor, and write the run folder.

Order matters for the lessons behind it: the target's config and files, each drafter (config, tensor table,
NaN/Inf, conversion of a checkpoint, no checkpoint named twice) and the gate are checked before any forward runs;
the references and features come from their caches when an earlier run made them under the same key (the run's
config says so); the run folder is created only then, and the drafter checkpoints are hard-linked into it::

    outcome = run_eval(plan, Console(stderr=True))
    outcome.run_dir / "summary.json"
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import httpx
import torch
from rich.console import Console

from dfserve.baselines import BaselineRegistry, OfflineScore
from dfserve.deploy.assets import Target, read_json, text_config
from dfserve.deploy.hashes import file_sha256, folder_sha256
from dfserve.deploy.profiles import HostProfile
from dfserve.errors import FieldError, UserError
from dfserve.eval import features as feat
from dfserve.eval import references as refs
from dfserve.eval.drafters import (
    DrafterContext,
    EvalDrafter,
    load_drafter,
    resolve_eval_drafter,
    same_weights,
    tensors_sha256,
    weights_sample,
)
from dfserve.eval.metrics import anchor_records, summarize_drafter
from dfserve.eval.progress import EvalProgress
from dfserve.eval.prompts import prompt_ids, prompt_settings
from dfserve.eval.records import (
    VANILLA,
    AnchorRecord,
    EvalConfig,
    EvalSummary,
    FeatureInfo,
    PromptSettings,
    ReferenceInfo,
    TargetInfo,
    TaskInfo,
    TaskSetInfo,
    ddtree_method,
)
from dfserve.eval.report import render_html
from dfserve.eval.scoring import TargetHead, score_anchors, torch_threads
from dfserve.eval.target import (
    describe_target,
    greedy_step,
    load_head,
    load_target,
    target_folder,
    teacher_forced,
)
from dfserve.eval.verdict import judge_offline, judged_against_itself, metrics_of
from dfserve.runs import (
    JsonlAppender,
    Provenance,
    create_run_dir,
    link_input,
    new_run_id,
    package_versions,
    run_name,
    utc_now_iso,
    write_atomic,
    write_model,
)
from dfserve.tasks import TaskSet
from dfserve.verdict.gate import Gate, check_rules

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EvalPlan:
    """Every setting of a run, as the command line gave it."""

    target: str
    drafters: tuple[tuple[str | None, str], ...]
    """(label or None, what names the drafter: zlab, baseline, a checkpoint or a folder); the first is the baseline."""
    profile: HostProfile
    drafter_config: Path | None
    tasks: TaskSet
    num_tasks: int
    max_new_tokens: int
    block_size: int | None
    ddtree_budgets: tuple[int, ...]
    prompt_format: Literal["chat", "raw"]
    thinking: bool
    reference: str
    """'local', or the URL of a running SGLang serving the target."""
    dtype: str
    anchors_per_forward: int
    cache: Path
    features: Path | None
    store: Path
    registry: Path
    out: Path
    name: str | None
    gate: Gate
    threads: int | None = None
    """CPU threads torch computes with; None: torch's default."""
    shard: tuple[int, int] | None = None
    """(i, n): only tasks i, i+n, ... of the first `num_tasks`, for a feature cache built in parts and merged
    (`cache_merge`); None: all of them."""

    def methods(self) -> list[str]:
        return [VANILLA, *(ddtree_method(b) for b in self.ddtree_budgets)]


@dataclass(frozen=True)
class EvalOutcome:
    run_dir: Path
    config: EvalConfig
    summary: EvalSummary


@dataclass
class _Prepared:
    """What the scoring needs once every asset is verified and the caches are filled."""

    target: Target
    folder: Path
    target_sha: str
    drafters: list[EvalDrafter]
    references: refs.ReferenceSet
    reference_info: ReferenceInfo
    store: feat.FeatureStore
    feature_info: FeatureInfo
    head: TargetHead
    prompt: PromptSettings
    models: dict[str, tuple[Any, torch.Tensor | None]]
    """Each drafter's model and mask embedding, by label, loaded before any reference or feature is made."""


def run_eval(plan: EvalPlan, console: Console) -> EvalOutcome:
    with torch_threads(plan.threads):
        return _run(plan, console)


def _run(plan: EvalPlan, console: Console) -> EvalOutcome:
    _quiet_transformers()
    run_id = new_run_id("eval") if plan.name is None else run_name(plan.name)
    if (plan.out / run_id).exists():
        raise FieldError("name", f"run directory {plan.out / run_id} already exists; runs are never overwritten")
    progress = EvalProgress(console)
    prepared = _prepare(plan, run_id, progress, console)
    if prepared.feature_info.health.warning:
        console.print(f"[bold red]warning:[/] {prepared.feature_info.health.warning}")
    drafters = [_staged(d, plan.out / run_id) for d in prepared.drafters]
    config = _config(plan, run_id, prepared, drafters)
    run_dir = create_run_dir(plan.out, run_id)
    try:
        for drafter in drafters:
            if drafter.checkpoint is not None and drafter.info.staged is not None:
                (run_dir / "inputs").mkdir(exist_ok=True)
                staged = link_input(drafter.checkpoint, Path(drafter.info.staged), "out")
                if file_sha256(staged, plan.store / ".hashes") != drafter.info.weights_sha256:
                    raise FieldError("drafter", f"{drafter.checkpoint} changed while the run prepared (a trainer "
                                     "saved over it): the run would keep other bytes than it scored; run it again")
    except UserError:
        shutil.rmtree(run_dir)
        raise
    write_model(run_dir / "config.json", config)
    records: dict[str, list[AnchorRecord]] = {d.info.label: [] for d in drafters}
    interrupted = False
    try:
        with JsonlAppender(run_dir / "anchors.jsonl") as out:
            for drafter in drafters:
                for record in _score(plan, prepared, drafter, prepared.models.pop(drafter.info.label), progress):
                    out.append(record)
                    records[drafter.info.label].append(record)
    except KeyboardInterrupt:
        interrupted = True
    summary = _summarize(plan, config, records, interrupted).model_copy(
        update={"records_sha256": file_sha256(run_dir / "anchors.jsonl"),
                "config_sha256": file_sha256(run_dir / "config.json")}).sealed()
    write_model(run_dir / "summary.json", summary)
    write_atomic(run_dir / "report.html", render_html(config, summary))
    if not interrupted and plan.shard is None:  # a part's τ is of some of the tasks, not the drafter's
        BaselineRegistry(plan.registry).record_offline(*_offline_scores(plan, config, summary, run_dir))
    return EvalOutcome(run_dir, config, summary)


def _quiet_transformers() -> None:
    """transformers reports loading through progress bars and log lines; the run has its own progress and errors."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def _prepare(plan: EvalPlan, run_id: str, progress: EvalProgress, console: Console) -> _Prepared:
    folder = target_folder(plan.target)
    target = describe_target(plan.target, folder)
    context = DrafterContext(plan.profile, target, plan.store, plan.drafter_config, plan.registry)
    drafters = [resolve_eval_drafter(spec, label, context) for label, spec in plan.drafters]
    labels = [d.info.label for d in drafters]
    if duplicate := next((label for label in labels if labels.count(label) > 1), None):
        raise FieldError("drafter", f"two drafters are labelled {duplicate!r}; name them LABEL=DRAFTER")
    _refuse_self_judged(drafters)  # by the files' hashes: before anything is loaded
    check_rules(plan.gate, metrics_of(plan.methods()))  # every rule names a method the run scores
    models = {d.info.label: load_drafter(d, DTYPES[plan.dtype]) for d in drafters}  # one that does not load: refused
    drafters = [replace(d, info=d.info.model_copy(update={"tensors_sha256": tensors_sha256(*models[d.info.label])}))
                for d in drafters]
    _refuse_self_judged(drafters, models)  # and by the tensors loaded, every value of them
    drafters = [replace(d, info=d.info.model_copy(update={"weights_sample": weights_sample(*models[d.info.label])}))
                for d in drafters]  # for runs judged against this one
    for drafter in drafters:
        if plan.block_size is not None and plan.block_size != drafter.info.block_size:
            console.print(f"[yellow]note:[/] {drafter.info.label} was trained with blocks of {drafter.info.block_size}; "
                          f"scoring it with blocks of {plan.block_size} changes its masks and positions")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise FieldError("target", f"{folder}: no tokenizer transformers can load ({str(exc).splitlines()[0]})") from None
    prompt = prompt_settings(tokenizer, plan.prompt_format, plan.thinking)
    tasks = plan.tasks.tasks[:plan.num_tasks]
    if plan.shard is not None:
        tasks = tasks[plan.shard[0]::plan.shard[1]]
    prompts = [prompt_ids(tokenizer, prompt, task) for task in tasks]
    target_sha = folder_sha256(folder, plan.store / ".hashes")  # the machine's memo of content hashes, with deploy's
    if plan.features is not None:
        feat.check_built_for(plan.features, target_sha, plan.target)
    local = plan.reference == "local"
    server = None if local else asyncio.run(_server_info(plan.reference))
    key = refs.ReferenceKey(
        target_sha256=target_sha, tasks_sha256=plan.tasks.sha256, task_ids=tuple(t.id for t in tasks), prompt=prompt,
        prompts_sha256=refs.prompts_sha256(prompts), max_new_tokens=plan.max_new_tokens,
        stop_ids=_stop_ids(folder, tokenizer) if local else (), source="local" if local else "sglang",
        server_model=None if server is None else server.model_path,
    )
    dtype = DTYPES[plan.dtype]
    model = None
    references = refs.cached_references(plan.cache, key)
    reused_references = references is not None
    if references is None:
        if local:
            model = load_target(folder, dtype)
        outputs = _make_references(plan, model, prompts, key.stop_ids, progress)
        references = refs.ReferenceSet(
            key=key, source=plan.reference, created_at=utc_now_iso(),
            references=tuple(refs.Reference(task=t.id, prompt_ids=tuple(p), output_ids=tuple(o), finish=f)
                             for t, p, (o, f) in zip(tasks, prompts, outputs, strict=True)))
        refs.check_vocabulary(references, target.vocab_size, plan.reference)
        references, reused_references = refs.keep_references(plan.cache, references)  # another run's, if it won
    else:
        refs.check_vocabulary(references, target.vocab_size, str(refs.reference_path(plan.cache, key)))
    if not any(len(reference.output_ids) >= 2 for reference in references.references):
        raise FieldError("max_new_tokens", "no task's reference output is two tokens or longer: there is no verify "
                         "round to score, and τ is undefined (raise it, or give tasks the target answers at length)")
    if server is not None and server.speculative_algorithm:
        console.print(f"[yellow]note:[/] {plan.reference} decodes with {server.speculative_algorithm}: its greedy "
                      "output should be the target's own, but verify kernels round differently from decode")
    reference_info = ReferenceInfo(source=plan.reference, server_model=key.server_model, key=key.digest()[:16],
                                   path=str(refs.reference_path(plan.cache, key).resolve()), reused=reused_references,
                                   created_at=references.created_at)
    taps = tuple(sorted({tap for d in drafters for tap in d.info.target_layer_ids}))
    feature_key = feat.FeatureKey(
        target_sha256=target_sha, target=plan.target, references_key=key.digest(),
        references_sha256=references.digest(), taps=taps, dtype=plan.dtype, versions=package_versions("torch", "transformers"),
    )
    path = plan.features or feat.features_path(plan.cache, feature_key)
    reused = plan.features is not None or path.is_dir()
    if not reused:
        model = model or load_target(folder, dtype)
        _build_features(model, references, feature_key, path, run_id, progress)
    try:
        store = feat.open_features(path, feature_key)
    except FieldError as exc:  # a folder of the cache's, not one `features` named
        if plan.features is not None:
            raise
        raise FieldError("cache", exc.message) from None
    build = store.build
    feature_info = FeatureInfo(key=feature_key.digest()[:16], path=str(path.resolve()), taps=taps, reused=reused,
                               built_at=build.built_at, built_by=build.built_by, build_s=build.build_s,
                               health=build.health)
    del model  # the drafters need only the features, the embedding and the head
    head = load_head(folder, target, dtype)
    return _Prepared(target, folder, target_sha, drafters, references, reference_info, store, feature_info, head,
                     prompt, models)


def _refuse_self_judged(drafters: list[EvalDrafter],
                        models: dict[str, tuple[Any, torch.Tensor | None]] | None = None) -> None:
    """Any two, since `eval compare` may pair any two of the run's drafters: one checkpoint by its hashes, and, once
    `models` are loaded, by its tensors in other precisions (`same_weights`)."""
    for index, drafter in enumerate(drafters):
        for earlier in drafters[:index]:
            first, second = earlier.info.label, drafter.info.label
            why = judged_against_itself(first, earlier.info, second, drafter.info)
            if why is None and models is not None and same_weights(models[first], models[second]):
                why = (f"drafters {first} and {second} hold one checkpoint's weights in other precisions: a drafter "
                       "is never judged against itself")
            if why is not None:
                raise FieldError("drafter", f"{why}; name it once")


async def _server_info(url: str) -> Any:
    async with httpx.AsyncClient(timeout=30.0) as client:
        return await refs.server_info(client, url)


def _stop_ids(folder: Path, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end generation: generation_config.json's, else the config's, else the tokenizer's."""
    sources = []
    if (folder / "generation_config.json").is_file():
        sources.append(read_json(folder / "generation_config.json", "target"))
    config = read_json(folder / "config.json", "target")
    sources += [config, dict(text_config(config))]
    for source in sources:
        value = source.get("eos_token_id")
        if isinstance(value, int):
            return (value,)
        if isinstance(value, list) and value:
            return tuple(int(v) for v in value)
    if tokenizer.eos_token_id is None:
        raise FieldError("target", f"{folder}: no end-of-sequence token in generation_config.json, config.json or "
                         "the tokenizer")
    return (int(tokenizer.eos_token_id),)


def _make_references(plan: EvalPlan, model: Any, prompts: list[list[int]], stop_ids: tuple[int, ...],
                     progress: EvalProgress) -> list[tuple[list[int], Any]]:
    with progress.stage("references", len(prompts)) as stage:
        if model is None:
            async def fetch() -> list[tuple[list[int], Any]]:
                async with httpx.AsyncClient(timeout=None) as client:
                    return await refs.fetch_sglang(client, plan.reference, prompts, plan.max_new_tokens, stage.advance)

            return asyncio.run(fetch())
        outputs = []
        for prompt in prompts:
            outputs.append(refs.greedy(lambda new, cache: greedy_step(model, new, cache), prompt,
                                       plan.max_new_tokens, stop_ids))
            stage.advance(1)
        return outputs


def _build_features(model: Any, references: refs.ReferenceSet, key: feat.FeatureKey, path: Path, run_id: str,
                    progress: EvalProgress) -> None:
    started = time.monotonic()
    agree = positions = 0
    with feat.write_features(path) as writer, progress.stage("target features", len(references.references)) as stage:
        for index, ref in enumerate(references.references):
            ids = [*ref.prompt_ids, *ref.output_ids]
            taps, agreed = teacher_forced(model, ids, len(ref.prompt_ids), key.taps)
            writer.task(index, taps)
            agree += agreed
            positions += len(ref.output_ids)
            stage.advance(1)
        writer.finish(feat.FeatureBuild(key=key, tasks=tuple(r.task for r in references.references),
                                        built_at=utc_now_iso(), built_by=run_id,
                                        build_s=time.monotonic() - started, health=feat.health(agree, positions),
                                        files=writer.files))


def _staged(drafter: EvalDrafter, run_dir: Path) -> EvalDrafter:
    """Where the drafter's trainer checkpoint is hard-linked in the run: the bytes evaluated stay, whatever the
    trainer later rotates away."""
    if drafter.checkpoint is None:
        return drafter
    staged = run_dir / "inputs" / f"{drafter.info.label}{drafter.checkpoint.suffix}"
    return EvalDrafter(drafter.info.model_copy(update={"staged": str(staged)}), drafter.folder, drafter.checkpoint)


def _config(plan: EvalPlan, run_id: str, prepared: _Prepared, drafters: list[EvalDrafter]) -> EvalConfig:
    target = prepared.target
    return EvalConfig(
        run_id=run_id,
        target=TargetInfo(model=plan.target, folder=str(prepared.folder), sha256=prepared.target_sha,
                          family=target.family, num_hidden_layers=target.num_hidden_layers,
                          hidden_size=target.hidden_size, vocab_size=target.vocab_size),
        prompt=prepared.prompt,
        tasks=TaskSetInfo(name=plan.tasks.name, sha256=plan.tasks.sha256, tasks=tuple(
            TaskInfo(id=r.task, prompt_tokens=len(r.prompt_ids), output_tokens=len(r.output_ids), finish=r.finish)
            for r in prepared.references.references)),
        max_new_tokens=plan.max_new_tokens, block_size=plan.block_size, ddtree_budgets=plan.ddtree_budgets,
        dtype=plan.dtype, anchors_per_forward=plan.anchors_per_forward, threads=torch.get_num_threads(),
        drafters=tuple(d.info for d in drafters),
        references=prepared.reference_info, features=prepared.feature_info,
        versions=package_versions("dfserve", "torch", "transformers", "dflash", "safetensors"), provenance=Provenance.here(),
    )


def _score(plan: EvalPlan, prepared: _Prepared, drafter: EvalDrafter, loaded: tuple[Any, torch.Tensor | None],
           progress: EvalProgress) -> Iterator[AnchorRecord]:
    """The drafter's records, task by task (streamed to the run as they come), from its model as loaded."""
    model, mask_embedding = loaded
    dtype = DTYPES[plan.dtype]
    references = prepared.references.references
    anchors = sum(max(0, len(r.output_ids) - 1) for r in references)
    with progress.stage(f"scoring {drafter.info.label} (anchors)", anchors) as stage:
        for index, ref in enumerate(references):
            tokens = [*ref.prompt_ids, *ref.output_ids]
            if len(ref.output_ids) < 2:
                continue
            context = prepared.store.context(index, drafter.info.target_layer_ids).to(dtype)
            scores = score_anchors(
                model, prepared.head, context, torch.tensor(tokens),
                torch.arange(len(ref.prompt_ids), len(tokens) - 1), top_k=max(plan.ddtree_budgets, default=1),
                anchors_per_forward=plan.anchors_per_forward, block_size=plan.block_size,
                mask_embedding=mask_embedding, on_forward=stage.advance,
            )
            yield from anchor_records(drafter.info.label, ref.task, tokens, len(ref.prompt_ids), scores,
                                      plan.ddtree_budgets)


def _summarize(plan: EvalPlan, config: EvalConfig, records: dict[str, list[AnchorRecord]],
               interrupted: bool) -> EvalSummary:
    task_ids = [t.id for t in config.tasks.tasks]
    methods = config.methods()
    summaries = tuple(summarize_drafter(d.label, records[d.label], task_ids, methods,
                                        plan.block_size or d.block_size) for d in config.drafters)
    baseline, *candidates = config.drafters
    judgements = tuple(judge_offline(baseline.label, records[baseline.label], c.label, records[c.label], task_ids,
                                     methods, plan.gate) for c in candidates) if not interrupted else ()
    return EvalSummary(run_id=config.run_id, interrupted=interrupted, drafters=summaries, judgements=judgements)


def _offline_scores(plan: EvalPlan, config: EvalConfig, summary: EvalSummary, run_dir: Path) -> list[OfflineScore]:
    scores = []
    for info, drafter in zip(config.drafters, summary.drafters, strict=True):
        vanilla = drafter.method(VANILLA)
        scores.append(OfflineScore(
            target=plan.target, drafter=info.identity, label=info.label, run_id=config.run_id,
            run_dir=str(run_dir.resolve()), features=config.features.key, tasks=len(vanilla.per_task),
            rounds=vanilla.rounds, tau=vanilla.tau.estimate, tau_low=vanilla.tau.low, tau_high=vanilla.tau.high,
            tau_as_sglang=vanilla.tau_as_sglang,
            ddtree={m.method: m.tau.estimate for m in drafter.methods if m.method != VANILLA},
            recorded_at=utc_now_iso(),
        ))
    return scores
