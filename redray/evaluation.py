"""Standard evaluations with lm-evaluation-harness, on redray's sharded Predictor.

``evaluate_tasks(tasks, run=... | model=...)`` scores a trained run (its newest
checkpoint, its model config and tokenizer) or a Hugging Face folder on the harness's
tasks; ``redray eval`` is the same from the command line. ``RedrayLM`` is the harness's
model interface (``lm_eval.api.model.LM``) over a redray model on a plan: the
log-likelihood of continuations, the rolling log-likelihood of whole texts, and greedy
generation until stop strings, each in batches of like lengths (padded to a few shapes,
so a handful of programs is compiled; the LM head runs on the scored positions only). A
model larger than one device is split over the axes given (``model_axis=2``...), as a
Trainer's is.

Needs the ``eval`` extra (``pip install "redray[eval]"``: lm-eval 0.4).
"""

from __future__ import annotations

import os

import numpy as np

# What the harness's results hold beside the scores.
NOT_SCORES = ("sample_len", "alias")
# Sequence lengths are padded up to the next of 32, 48, 64, 96, 128, 192...: a shape per
# half octave, so a task compiles a few programs, with at most a third of a row padding.
SHORTEST = 32


def _harness():
    try:
        import lm_eval  # noqa: F401
        from lm_eval.api.model import LM
    except ImportError:
        raise ImportError("evaluation needs lm-evaluation-harness: pip install "
                          "'redray[eval]'") from None
    return LM


def _padded(length: int) -> int:
    width = SHORTEST
    while width < length:
        width = width * 3 // 2 if width & (width - 1) == 0 else width * 4 // 3
    return width


def _length_batches(lengths: list[int], size: int) -> list[list[int]]:
    """The indices of ``lengths``, longest first, in batches of ``size``: each batch
    is padded to its own longest, and only the last has padding rows."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[start:start + size] for start in range(0, len(order), size)]


def _score_collate(examples: list[dict]) -> dict:
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def _score(model, batch, rng):
    """Per row: the summed log-probability of its scored tokens and whether each is the
    greedy choice. ``ids``: the row, right-padded; ``positions``: where (in ``ids[:,
    :-1]``) each scored token is predicted, ``tokens`` the token, ``valid`` which of the
    (padded) positions count. The head runs on the scored positions only (a model with
    ``hidden=True`` and ``logits``, as redray's decoders), else on every position."""
    import jax
    import jax.numpy as jnp

    inputs, positions = batch["ids"][:, :-1], batch["positions"]
    if hasattr(model, "logits"):
        hidden = model(inputs, hidden=True)
        logits = model.logits(jnp.take_along_axis(hidden, positions[..., None], axis=1))
    else:
        logits = jnp.take_along_axis(model(inputs), positions[..., None], axis=1)
    logits = logits.astype(jnp.float32)
    tokens, valid = batch["tokens"], batch["valid"] > 0
    picked = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    token = picked - jax.nn.logsumexp(logits, axis=-1)
    greedy = (jnp.argmax(logits, axis=-1) == tokens) | ~valid
    return {"logprob": jnp.sum(jnp.where(valid, token, 0.0), axis=-1),
            "greedy": jnp.all(greedy, axis=-1)}


class RedrayLM:
    """The harness's model over a redray causal LM on a plan.

    Args:
      model: a function building the ``flax.nnx`` model (e.g. ``lambda rngs:
        redray.models.build(config, rngs=rngs)``).
      params, extra: its weights (``redray.load_params``; None: fresh).
      tokenizer: a ``transformers`` tokenizer.
      batch_size: rows per program call (a multiple of the data-parallel size).
      max_length: the longest sequence scored (default the config's
        ``max_position_embeddings``, else 2048); longer inputs keep their end.
      max_gen_toks: new tokens a generation request may take, unless it says.
      **axes: the plan's axis sizes (``model_axis=2``...), as for ``Trainer``.
    """

    def __init__(self, model, tokenizer, *, params=None, extra=None, batch_size: int = 8,
                 max_length: int | None = None, max_gen_toks: int = 256, **axes):
        super().__init__()
        from redray.engine.predictor import Predictor

        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self._model, self._axes = model, axes
        self._weights = (params, extra)
        self._scorer = Predictor(model, _score_collate, _score, params=params, extra=extra,
                                 batch_size=batch_size, **axes)
        self.max_length = max_length or 2048
        self._generators: dict = {}
        eos = tokenizer.eos_token_id
        self.eot_token_id = eos
        self.prefix_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id \
            is not None else eos

    # ------------------------------------------------------------ chat templates
    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's name, as the harness keys its caches and results by it."""
        return str(getattr(self.tokenizer, "name_or_path", "") or "").replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template ``apply_chat_template`` renders with: the tokenizer's (a
        named one of a tokenizer's dict of templates, or its ``default``); None
        where none is asked for; a ``ValueError`` where the tokenizer has none."""
        if chat_template is False or chat_template is None:
            return None
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):
            name = chat_template if isinstance(chat_template, str) else "default"
            if name not in template:
                raise ValueError(f"the tokenizer has no chat template {name!r}; it has "
                                 f"{sorted(template)}")
            template = template[name]
        if not template:
            raise ValueError("--apply-chat-template: the tokenizer has no chat template "
                             "(tokenizer_config.json's \"chat_template\" or "
                             "chat_template.jinja in its folder); give --tokenizer a "
                             "folder that has one")
        return template

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        """A conversation (a task's few-shot turns and its question) as the chat
        template renders it: ending with the assistant's turn opened (or, without
        the generation prompt, its last message left open to continue), as the
        harness's Hugging Face model renders it, a template that refuses system
        messages given the conversation without them."""
        import jinja2

        kw = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                  continue_final_message=not add_generation_prompt)
        try:
            return self.tokenizer.apply_chat_template(chat_history, **kw)
        except jinja2.exceptions.TemplateError:
            return self.tokenizer.apply_chat_template(
                [m for m in chat_history if m["role"] != "system"], **kw)

    # ------------------------------------------------------------ the harness's calls
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        pairs = [self._encode_pair(*r.args) for r in requests]
        return self._score_pairs(pairs)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        from lm_eval import utils

        pairs, owner = [], []
        for i, request in enumerate(requests):
            tokens = self.tokenizer.encode(request.args[0], add_special_tokens=False)
            for window in utils.get_rolling_token_windows(
                    tokens, self.prefix_token_id, self.max_length, context_len=1):
                pairs.append(utils.make_disjoint_window(window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._score_pairs(pairs)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False):
        out = [""] * len(requests)
        by_new: dict = {}  # one generating program per number of new tokens
        for i, request in enumerate(requests):
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            if self.tokenizer.eos_token and self.tokenizer.eos_token not in until:
                until.append(self.tokenizer.eos_token)
            new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.tokenizer.encode(context, add_special_tokens=False) \
                or [self.prefix_token_id]
            ids = ids[-(self.max_length - new):]
            by_new.setdefault(new, []).append((i, ids, until))
        for new, members in by_new.items():
            for chunk in _length_batches([len(ids) for _, ids, _ in members],
                                         self.batch_size):
                width = _padded(max(len(members[j][1]) for j in chunk))
                rows = []
                for j in chunk:  # left-padded prompts
                    ids = members[j][1]
                    pad = width - len(ids)
                    rows.append({"ids": np.array([0] * pad + ids, np.int32),
                                 "mask": np.array([0] * pad + [1] * len(ids), np.int32)})
                for j, row in zip(chunk, self._generator(new).predict(rows)):
                    i, _, until = members[j]
                    text = self.tokenizer.decode(np.asarray(row).tolist(),
                                                 skip_special_tokens=False)
                    for stop in until:
                        text = text.split(stop)[0]
                    out[i] = text
        return out

    # ------------------------------------------------------------ the work
    def _encode_pair(self, context: str, continuation: str):
        """(context tokens, continuation tokens) as the harness's HF model cuts them:
        the context's trailing spaces go with the continuation, and the continuation's
        tokens are those of the whole text after the context's."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        whole, head = encode(context + continuation), encode(context)
        tail = whole[len(head):]
        return (head or [self.prefix_token_id]), tail

    def _score_pairs(self, pairs: list) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each (context, continuation) token pair:
        longest first, in batches of ``batch_size`` padded to the batch's longest
        (``_padded``), so only the last batch has padding rows."""
        out: list = [None] * len(pairs)
        rows = []
        for context, continuation in pairs:
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((whole, min(len(continuation), len(whole) - 1)))
        for chunk in _length_batches([len(whole) for whole, _ in rows], self.batch_size):
            width = _padded(max(len(rows[i][0]) for i in chunk))
            scored = min(_padded(max(rows[i][1] for i in chunk)), width - 1)
            batch = []
            for i in chunk:
                whole, count = rows[i]
                ids = np.zeros(width, np.int32)
                ids[:len(whole)] = whole
                positions = np.zeros(scored, np.int32)
                positions[:count] = np.arange(len(whole) - 1 - count, len(whole) - 1)
                tokens = np.zeros(scored, np.int32)
                tokens[:count] = whole[len(whole) - count:]
                valid = np.zeros(scored, np.int32)
                valid[:count] = 1
                batch.append({"ids": ids, "positions": positions, "tokens": tokens,
                              "valid": valid})
            for i, result in zip(chunk, self._scorer.predict(batch)):
                out[i] = (float(result["logprob"]), bool(result["greedy"]))
        return out

    def _generator(self, new: int):
        """The Predictor generating ``new`` tokens greedily (one per length)."""
        if new not in self._generators:
            from redray.engine.predictor import Predictor
            from redray.models import generate

            def predict(model, batch, rng):
                return generate(model, batch["ids"], batch["mask"], max_new_tokens=new,
                                eos_token_id=self.eot_token_id)

            params, extra = self._weights
            self._generators[new] = Predictor(
                self._model, _score_collate, predict, params=params, extra=extra,
                batch_size=self.batch_size, **self._axes)
        return self._generators[new]


def lm_class():
    """``RedrayLM`` on lm-eval's base class (imported here, on first use)."""
    LM = _harness()
    return type("RedrayLM", (RedrayLM, LM), {"__doc__": RedrayLM.__doc__,
                                             "__module__": __name__})


def evaluate_tasks(tasks, *, run: str | None = None, model: str | None = None,
                   storage: str | None = None, tokenizer=None, include_path=None,
                   batch_size: int = 8, limit: int | float | None = None,
                   num_fewshot: int | None = None, max_length: int | None = None,
                   samples: str | None = None, track: bool = True,
                   apply_chat_template: bool | str = False, fewshot_as_multiturn: bool = True,
                   hosts: int | None = None, devices_per_host: int | None = None,
                   show: bool = True, **axes) -> dict[str, dict[str, float]]:
    """Scores a model on lm-evaluation-harness tasks; returns {task: {measure: value}}.

    Args:
      tasks: task names (or one), as the harness knows them, or found under
        ``include_path``.
      run: a trained run (a run folder, or a name in ``storage``): its newest
        checkpoint, its ``config.json`` and its ``tokenizer`` folder. The scores go to
        the run's MLflow run (``eval/<task>/<measure>`` at its last step) unless
        ``track=False``.
      model: or a Hugging Face folder (``config.json`` and safetensors, its tokenizer).
      tokenizer: a tokenizer folder or ``transformers`` tokenizer, overriding the
        run's or the folder's.
      include_path: a folder (or folders) of the harness's task YAML files, e.g. tasks
        over local data files.
      batch_size, max_length: as for ``RedrayLM``.
      limit, num_fewshot: the harness's (examples per task; few-shot examples).
      samples: a JSON lines file to write every example to: its task, document index,
        the requests' arguments and the model's responses (a log-likelihood and whether
        greedy, or the generated text).
      apply_chat_template: render each request as a conversation with the tokenizer's
        chat template (True, or the name of one of a tokenizer's named templates), as
        the harness's own ``apply_chat_template``: what an instruct model is scored on.
      fewshot_as_multiturn: with a chat template, the few-shot examples as earlier
        turns of the conversation (the harness's default with a template).
      hosts, devices_per_host: evaluate on that many hosts of a Ray cluster (on one
        machine: simulated ones, each with ``devices_per_host`` CPU devices), one plan
        over all their devices (``redray.run``); default: this process's devices.
      show: print the scores' table (process 0).
      **axes: the plan's axis sizes (``model_axis=2``...).
    """
    _harness()
    if (run is None) == (model is None):
        raise ValueError("give one of run= (a trained redray run) or model= (a Hugging "
                         "Face folder)")
    options = dict(run=run, model=model, storage=storage, tokenizer=tokenizer,
                   include_path=include_path, batch_size=batch_size, limit=limit,
                   num_fewshot=num_fewshot, max_length=max_length, samples=samples,
                   track=track, apply_chat_template=apply_chat_template,
                   fewshot_as_multiturn=fewshot_as_multiturn, show=False, **axes)
    if hosts is not None:  # the hosts score (paths made absolute); this process shows, tracks
        folder = run is not None and os.path.isdir(run)
        scores = _on_hosts(tasks, dict(
            options, model=_absolute(model), tokenizer=_absolute(tokenizer),
            include_path=_absolute(include_path), samples=_absolute(samples),
            storage=_absolute(storage), run=_absolute(run) if folder else run, track=False),
            hosts, devices_per_host)
        if show:
            print(table(scores), flush=True)
        if track and run is not None:
            _track(_run_folders(run, storage), scores)
        return scores
    import jax

    scores, folders = _scores_here(tasks, run, model, storage, tokenizer, include_path,
                                   batch_size, limit, num_fewshot, max_length, samples,
                                   apply_chat_template, fewshot_as_multiturn, axes)
    if show and jax.process_index() == 0:
        print(table(scores), flush=True)
    if track and folders is not None:
        _track(folders, scores)
    return scores


def _scores_here(tasks, run, model, storage, tokenizer, include_path, batch_size, limit,
                 num_fewshot, max_length, samples, apply_chat_template, fewshot_as_multiturn,
                 axes) -> tuple[dict, list | None]:
    """``evaluate_tasks`` on this process's devices (its arguments): (the scores, the
    run's folders to track them in, or None for a Hugging Face folder)."""
    import jax
    import lm_eval
    from lm_eval.tasks import TaskManager

    factory, params, extra, tokenizer, folders, config = _source(run, model, storage,
                                                                  tokenizer)
    lm = lm_class()(factory, tokenizer, params=params, extra=extra, batch_size=batch_size,
                    max_length=max_length or getattr(config, "max_position_embeddings", None),
                    **axes)
    names = [tasks] if isinstance(tasks, str) else list(tasks)
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    if apply_chat_template:
        lm.chat_template(apply_chat_template)  # a tokenizer without one: refused here
    found = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                                    num_fewshot=num_fewshot, log_samples=samples is not None,
                                    bootstrap_iters=0, apply_chat_template=apply_chat_template,
                                    fewshot_as_multiturn=fewshot_as_multiturn)
    if samples is not None and jax.process_index() == 0:  # every host has them all
        _write_samples(samples, found["samples"])
    scores = {task: {_measure(k): float(v) for k, v in values.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)
                     and "_stderr" not in k and k not in NOT_SCORES}
              for task, values in found["results"].items()}
    return scores, folders


def _absolute(path):
    return os.path.abspath(path) if isinstance(path, (str, os.PathLike)) else path


def _on_hosts(tasks, options: dict, hosts: int, devices_per_host: int | None) -> dict:
    """``evaluate_tasks`` on every host of a ``redray.run`` (each runs the harness on
    the same requests; the Predictor splits each batch over all hosts' devices); host
    0's scores."""
    import tempfile

    from redray.cluster import run

    with tempfile.TemporaryDirectory() as scratch:
        done = run(evaluate_tasks, tasks, hosts=hosts, devices_per_host=devices_per_host,
                   name="evaluation", storage_path=scratch, checkpoint=False, tracking=False,
                   resume=False, **options)
    return done.value


def _write_samples(path: str, samples: dict) -> None:
    import json

    with open(path, "w") as f:
        for task, rows in samples.items():
            for row in rows:
                f.write(json.dumps({"task": task, "doc_id": row["doc_id"],
                                    "arguments": [list(a) for a in row["arguments"]],
                                    "responses": row["resps"]}, default=str) + "\n")


def _measure(key: str) -> str:
    """The harness's "acc,none" as "acc"; a filtered measure keeps its filter."""
    measure, _, flt = key.partition(",")
    return measure if flt in ("", "none") else f"{measure}_{flt}"


def table(scores: dict) -> str:
    """The scores as a text table: task, measure, value."""
    rows = [(task, measure, f"{value:.4f}") for task, values in sorted(scores.items())
            for measure, value in sorted(values.items())]
    width = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in
             enumerate(("task", "measure", "value"))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(("task", "measure", "value"), width))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows]
    return "\n".join(lines)


def _source(run, model, storage, tokenizer):
    """(model factory, params, extra, tokenizer, the run's folders or None, the model's
    config)."""
    from transformers import AutoTokenizer

    from redray.models import build, load_config

    folders = None if model is not None else _run_folders(run, storage)
    if folders is not None and not os.path.exists(folders.model_config):
        raise FileNotFoundError(
            f"no model config at {folders.model_config}: redray eval scores a run of a "
            "redray.models model (its config.json in the run folder), or give a Hugging "
            "Face folder with model=")
    config = load_config(model if folders is None else folders.model_config)
    if getattr(config, "is_encoder_decoder", False):  # before any weight is read
        raise ValueError(f"{config.model_type} is an encoder-decoder model: redray eval "
                         "scores causal language models (their continuation's tokens after "
                         "the context's)")
    factory = lambda rngs: build(config, rngs=rngs)  # noqa: E731
    if folders is None:
        params, extra = _hf_weights(model)
        folder = model
    else:
        from redray.engine.load import load_params

        params, extra = load_params(folders.run, factory)
        folder = folders.tokenizer
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        where = tokenizer or folder
        if not os.path.isdir(where):
            raise FileNotFoundError(f"no tokenizer at {where}: give one (tokenizer=, or "
                                    "--tokenizer: a folder a transformers tokenizer was "
                                    "saved to)")
        tokenizer = AutoTokenizer.from_pretrained(where)
    return factory, params, extra, tokenizer, folders, config


def _run_folders(run: str, storage: str | None):
    """The folders of a run given as its folder, or as its name in ``storage``."""
    from redray import storage as storage_module

    if os.path.isdir(run):
        run = os.path.abspath(run)
        return storage_module.RunFolders.of(os.path.dirname(run), os.path.basename(run))
    return storage_module.RunFolders.of(storage, run)


def _hf_weights(folder: str):
    """(params, extra) of a Hugging Face folder, as host arrays in the model's structure."""
    import jax
    from flax import nnx

    from redray.models import from_pretrained

    module = from_pretrained(folder)
    _, params, extra = nnx.split(module, nnx.Param, ...)
    return jax.device_get((params, extra))


def _track(folders, scores: dict) -> None:
    """The scores as metrics of the run's MLflow run (``eval/<task>/<measure>``), at the
    newest step it logged; from process 0 only."""
    import time

    import jax
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from redray.tracking import RUN_PATH_TAG

    if jax.process_index() != 0:
        return
    client = MlflowClient(folders.tracking_uri)
    found = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`{RUN_PATH_TAG}` = '{folders.run}'",
        order_by=["attributes.start_time DESC"], max_results=1)
    if not found:
        return
    run = found[0].info.run_id
    step = max((m.step for m in client.get_metric_history(run, "loss")), default=0)
    stamp = int(time.time() * 1000)
    client.log_batch(run, metrics=[Metric(f"eval/{task}/{measure}", value, stamp, step)
                                   for task, values in scores.items()
                                   for measure, value in values.items()])
