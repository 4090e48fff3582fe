"""``OtfloadLM``: the ``otfload`` model of lm-evaluation-harness.

    lm_eval.simple_evaluate(model=OtfloadLM("org/name", mesh="fsdp:8"), tasks=["hellaswag"])
    lm_eval.simple_evaluate(model="otfload", model_args="pretrained=org/name,dtype=bf16", tasks=[...])

The model is loaded by :func:`~otfload.api.from_pretrained` (any source, mesh, dtype, adapter,
quantized mode: the ``model_args``), on a thread (:mod:`otfload.lm_eval.loading`), so lm_eval
builds its requests and the scoring step compiles while the weights arrive. Requests are answered
as lm_eval's ``hf`` backend answers them, so the numbers compare:

* tokenization (:mod:`otfload.lm_eval.tokens`): special tokens added as the tokenizer's
  post-processor adds them unless ``add_bos_token`` says otherwise, and not when the text already
  starts with the BOS token; an empty context is the prefix token (BOS, else EOS);
* ``loglikelihood`` (lm_eval's ``TemplateLM`` splits context and continuation, trailing spaces
  moving to the continuation) and ``loglikelihood_rolling`` (lm_eval's disjoint rolling windows of
  ``max_length``, summed) are scored by :mod:`otfload.lm_eval.scoring`, the continuations of one
  context (a multiple-choice question's choices) scored in one pass over it (one request a row for
  a model with a recurrent layer: ``packs_sequences``);
* ``generate_until`` by :mod:`otfload.lm_eval.generation`: greedy, stop strings, ``max_gen_toks``;
* ``apply_chat_template`` (lm_eval's ``--apply_chat_template``) renders the checkpoint's chat
  template as transformers does (:mod:`otfload.lm_eval.chat`).

In a ``jax.distributed`` job the mesh says how the processes share the work. On a mesh of its own
devices each process is one of lm_eval's ranks (``rank`` its process index, ``world_size`` the
process count): lm_eval gives it every ``world_size``-th document, it scores them, and lm_eval
gathers the metrics to process 0, which alone gets the results; the gathers and barriers go
through the job's key-value store (:mod:`otfload.lm_eval.ranks`). On a mesh spanning every process
(a model too large for one host) the processes drive one replica together: each runs every request,
each batch sharded over the mesh's batch axes, and each gets the results (process 0 writes them).

Compiled programs are kept across jobs (:mod:`otfload.compile_cache`): when lm_eval builds the
backend from ``model_args`` (``lm_eval run --model otfload``, ``simple_evaluate(model="otfload")``)
in ``$OTFLOAD_COMPILE_CACHE``, else ``~/.cache/otfload/xla``, unless ``compile_cache=off``; an
``OtfloadLM`` built in Python keeps them where ``compile_cache=DIR`` says, else where JAX's own
``jax_compilation_cache_dir`` is set, if it is.

``max_length`` defaults to the config's ``n_positions``/``max_position_embeddings``/``n_ctx`` (its
``text_config`` first), else 2048, as lm_eval resolves it. ``timings`` holds the seconds spent
loading, compiling (the scoring and the decoding steps' programs), scoring and generating.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm.auto import tqdm

from otfload.compile_cache import enable_compile_cache
from otfload.coordination import LocalCoordinator
from otfload.errors import InvalidOptionError
from otfload.lm_eval.chat import render_chat, select_template
from otfload.lm_eval.generation import Generator, generation_options, options_key
from otfload.lm_eval.loading import BackgroundLoad
from otfload.lm_eval.ranks import Ranks, join_job
from otfload.lm_eval.scoring import Scorer, Timings, TokenRequest, make_groups, spans_processes
from otfload.models.base import CausalLM
from otfload.plan.sharding import make_mesh, parse_mesh_spec
from otfload.sources.base import Source

DEFAULT_BATCH_SIZE = 16  # rows per forward pass; a multiple of the usual data-parallel mesh sizes
DEFAULT_MAX_LENGTH = 2048  # lm_eval's HF backend's, for a config that names no context length
DEFAULT_MAX_GEN_TOKS = 256  # lm_eval's HF backend's
SEQ_LEN_KEYS = ("n_positions", "max_position_embeddings", "n_ctx")  # in lm_eval's order


@register_model("otfload")
class OtfloadLM(TemplateLM):  # type: ignore[misc]  # lm_eval is untyped: its classes are Any
    """An lm_eval model scored by otfload. ``pretrained`` is any location ``from_pretrained``
    takes; ``mesh`` a ``Mesh``, a dict of axis sizes or ``"fsdp:2/tp:4"`` (``fsdp=2,tp=4`` where
    commas are free) over this process's devices, or in a ``jax.distributed`` job over every
    process's when the sizes multiply to their count (see the module's docstring); other keywords
    (``dtype``, ``adapter``, ``quantized``, ``revision``, ...) go to ``from_pretrained``.
    ``batch_size`` rows per forward pass (``"auto"``: the default);
    ``device`` and ``max_batch_size`` (lm_eval's CLI passes them) are not used: the mesh says
    where the model runs. ``coordinator`` (``host:port``), ``num_processes`` and ``process_id``
    make this process one of a ``jax.distributed`` job first (``jax.distributed.initialize``): how
    lm_eval's own command line runs one process of a multi-process job. ``compile_cache``: a
    directory to keep compiled programs in for later jobs (JAX's persistent cache, turned on for
    the process), ``"off"`` or None to leave JAX's setting as it is; lm_eval's ``model_args`` have
    it on by default (see the module docstring). ``progress``: None shows
    lm_eval's bars as it asks (the load's not), True shows the load's bar too, False none."""

    def __init__(
        self,
        pretrained: str | os.PathLike[str] | Source,
        *,
        mesh: Mesh | Mapping[str, int] | str | None = None,
        batch_size: int | str = DEFAULT_BATCH_SIZE,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        progress: bool | None = None,
        device: str | None = None,
        max_batch_size: int | None = None,
        coordinator: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        compile_cache: str | os.PathLike[str] | None = None,
        **load_options: Any,
    ) -> None:
        super().__init__()
        del device, max_batch_size  # accepted for lm_eval's CLI; the mesh places the model
        join_job(coordinator, num_processes, process_id)  # before anything starts JAX's backend
        if compile_cache is not None:
            enable_compile_cache(compile_cache)
        self.timings = Timings()
        self._batch_size = _batch_size(batch_size)
        self.mesh = _mesh(mesh)
        # A mesh of this process's devices is one of lm_eval's ranks; one spanning every process is one
        # replica that all processes drive together, each with every request: a single rank.
        self.ranks = Ranks(LocalCoordinator() if spans_processes(self.mesh) else None)
        self._rank, self._world_size = self.ranks.rank, self.ranks.world_size  # lm_eval's LM reads these
        self.progress = progress
        self._load = BackgroundLoad(pretrained, mesh=self.mesh, progress=bool(progress), **load_options)
        self.tokenizer = self._load.tokenizer
        self._max_length = max_length if max_length is not None else _config_max_length(self._load.config)
        self._max_gen_toks = max_gen_toks
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._loaded: CausalLM | None = None
        self.scorer = Scorer(self._batch_size, self._max_length, self.mesh, self._load.abstract, self.timings,
                             self._load.packs_sequences)
        self.generator = Generator(self.tokenizer, self._batch_size, self.timings)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
                            ) -> OtfloadLM:
        """How lm_eval builds the backend from ``model_args`` (a job): compiled programs kept in
        the default directory unless ``compile_cache`` says otherwise."""
        if "compile_cache" not in arg_dict:
            enable_compile_cache(None)  # the command line's default (a warning where it cannot be made)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None
                               ) -> OtfloadLM:
        """``model_args`` as lm_eval's command line gives them (``key=value,...``); see
        :meth:`create_from_arg_obj`."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def close(self) -> None:
        """Stop a load still running and close its source (a job that ends before scoring)."""
        self._load.close()

    # --- what lm_eval asks of a model ---------------------------------------------------------

    @property
    def model(self) -> CausalLM:
        """The loaded model (waits for the load on first use)."""
        if self._loaded is None:
            self._loaded = self._load.model()
            self.timings.load_seconds = self._load.seconds or 0.0
        return self._loaded

    @property
    def eot_token_id(self) -> int:
        if self.tokenizer.eos_id is None:
            raise InvalidOptionError("the checkpoint's tokenizer names no EOS token (tokenizer_config.json "
                                     "eos_token or config.json eos_token_id): lm_eval needs one")
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> str:
        """Where lm_eval keeps its bookkeeping tensors (request counts) in a multi-process job."""
        return "cpu"

    def all_gather(self, tensor: Any) -> Any:
        return self.ranks.all_gather(tensor)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        return self.ranks.gather_object(obj, dst)

    def barrier(self) -> None:
        self.ranks.barrier()

    @property
    def tokenizer_name(self) -> str:
        return str(self._load.config.get("_name_or_path", "otfload")).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat as the checkpoint's chat template renders it (:mod:`otfload.lm_eval.chat`): a
        generation prompt after it, else its final message left open."""
        template = select_template(self.tokenizer.chat_template)
        return render_chat(template, chat_history, self.tokenizer.special_tokens_map, add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """lm_eval's rule: ``add_special_tokens`` if given, else ``add_bos_token`` if set, else the
        tokenizer's own (its post-processor); never a second BOS before a text that starts with one."""
        add = self._add_special(add_special_tokens, string)
        ids = self.tokenizer.encode(string, add_special_tokens=add)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int] | int, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([tokens] if isinstance(tokens, int) else tokens, skip_special_tokens)

    def _loglikelihood_tokens(self, requests: list[TokenRequest], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        groups = make_groups([(context, continuation) for _, context, continuation in requests], self.max_length,
                             self._load.sliding_window, packs=self.scorer.packs)
        with self._bar(len(requests), "loglikelihood", disable_tqdm) as bar:
            answers = self.scorer.score(groups, lambda: self.model, bar.update)
        for (strings, _, _), answer in zip(requests, answers, strict=True):
            if strings is not None:  # rolling windows carry no strings: cached per text below
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over lm_eval's disjoint rolling windows of ``max_length``,
        all windows of all texts scored as one job."""
        windows: list[TokenRequest] = []
        owner: list[int] = []
        for i, (text,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(text)
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, scores, strict=True):
            totals[i] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, requests with equal ``gen_kwargs`` batched together."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(options_key(req.args[1]), []).append(i)
        out = [""] * len(requests)
        eos_text = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        with self._bar(len(requests), "generate_until", disable_tqdm) as bar:
            for members in groups.values():
                options = generation_options(requests[members[0]].args[1], self.max_gen_toks, eos_text)
                max_context = self.max_length - options.max_gen_toks
                if max_context < 1:
                    raise InvalidOptionError(f"max_gen_toks {options.max_gen_toks} leaves no room for a context in "
                                             f"max_length {self.max_length}")
                contexts = [requests[i].args[0] for i in members]
                prompts = self._encode_contexts(contexts, max_context)
                for i, text in zip(members, self.generator.run(self.model, prompts, options, bar.update), strict=True):
                    out[i] = text
        for req, text in zip(requests, out, strict=True):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    # --- helpers ------------------------------------------------------------------------------

    def _add_special(self, add_special_tokens: bool | None, string: str) -> bool:
        if add_special_tokens is not None:
            return add_special_tokens
        prefix = self.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
        if prefix and string.startswith(prefix):
            return False
        return self.add_bos_token if self.add_bos_token is not None else True

    def _encode_contexts(self, contexts: list[str], max_context: int) -> list[list[int]]:
        """lm_eval's batch encoding: one decision for the whole batch (by its first text), then each
        context cut on the left to ``max_context`` ids."""
        bos = self.tokenizer.bos_token
        if bos is not None and contexts[0].startswith(bos):
            add = False
        else:
            add = self.add_bos_token if self.add_bos_token is not None else True
        return [ids[-max_context:] for ids in self.tokenizer.encode_batch(contexts, add_special_tokens=add)]

    def _bar(self, total: int, desc: str, disable: bool) -> tqdm[Any]:
        show = not disable if self.progress is None else self.progress
        return tqdm(total=total, desc=f"otfload {desc}", disable=not show or jax.process_index() != 0)


def _mesh(mesh: Mesh | Mapping[str, int] | str | None) -> Mesh:
    """A ``Mesh`` from lm_eval's ``model_args`` (``"fsdp:2/tp:4"``), a dict or a ``fsdp=2,tp=4``
    string: over this process's devices (None: all of them on ``fsdp``), or, in a job of several
    processes, over every process's devices when the sizes multiply to their number. A ``Mesh`` is
    used as it is: of this process's devices, or of every process's."""
    if not isinstance(mesh, Mesh):
        if isinstance(mesh, str):
            mesh = parse_mesh_spec(mesh.replace(":", "=").replace("/", ","))
        every = jax.devices()
        if mesh is not None and jax.process_count() > 1 and math.prod(mesh.values()) == len(every):
            return make_mesh(mesh, every)
        return make_mesh(mesh, jax.local_devices())
    processes = {d.process_index for d in mesh.devices.flat}
    if 1 < len(processes) < jax.process_count():
        raise InvalidOptionError(
            f"mesh {dict(mesh.shape)} spans processes {sorted(processes)} of {jax.process_count()}: the lm_eval "
            "backend runs on a mesh of each process's own devices (each process scores a share of the documents) "
            "or on one spanning every process (every batch sharded over its batch axes)")
    return mesh


def _batch_size(value: int | str) -> int:
    if isinstance(value, str) and value.startswith("auto"):
        return DEFAULT_BATCH_SIZE
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise InvalidOptionError(f"batch_size must be a positive integer or 'auto'; got {value!r}")
    return size


def _config_max_length(config: Mapping[str, Any]) -> int:
    text_config = config.get("text_config")
    for cfg in (text_config, config) if isinstance(text_config, Mapping) else (config,):
        for key in SEQ_LEN_KEYS:
            if cfg.get(key) is not None:
                return int(cfg[key])
    return DEFAULT_MAX_LENGTH
