"""What the connector takes from vLLM, and the checks that a vLLM still has it.

Written once and run against whatever vLLM is importable: the venv's 0.32 in the main
suite, each release of requirements/vllm-releases.txt in ``test_vllm_releases`` (a
subprocess with the release's modules ahead on the path). Every check returns the
problems it found as sentences that name what moved, so a failing test says what to fix.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# The code that runs inside vLLM's processes, or reads vLLM objects.
SOURCES = ("connector/encoderpool_connector", "contracts/encoderpool_contracts")

# The connector classes vLLM loads (module, class), as the operator renders them.
CONNECTORS = (
    ("encoderpool_connector.shared_volume", "EncoderPoolSharedVolumeConnector"),
    ("encoderpool_connector.rdma", "EncoderPoolNixlConnector"),
)
BASE = ("vllm.distributed.ec_transfer.ec_connector.base", "ECConnectorBase")

# What the connector reads on vLLM's objects (module, class, members), beyond the names it
# imports: found by reading the connector's code for each object it is handed.
MEMBERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("vllm.distributed.ec_transfer.ec_connector.base", "ECConnectorBase",
     ("role", "is_producer", "is_consumer", "_get_connector_metadata")),
    ("vllm.distributed.ec_transfer.ec_connector.base", "ECConnectorWorkerMetadata",
     ("aggregate",)),
    ("vllm.distributed.ec_transfer.ec_connector.base", "ECConnectorRole",
     ("SCHEDULER", "WORKER")),
    ("vllm.distributed.ec_transfer.ec_connector.utils", "PlaceholderMetadataResolver",
     ("fields_for",)),
    ("vllm.v1.request", "Request",
     ("request_id", "mm_features", "ec_transfer_params", "get_num_encoder_embeds")),
    ("vllm.multimodal.inputs", "MultiModalFeatureSpec",
     ("identifier", "modality", "mm_position", "data")),
    ("vllm.multimodal.inputs", "PlaceholderRange", ("offset", "length", "get_num_embeds")),
    ("vllm.v1.core.sched.output", "SchedulerOutput", ("scheduled_encoder_inputs",)),
    ("vllm.v1.outputs", "ECConnectorOutput", ("ec_connector_worker_meta",)),
    ("vllm.config", "VllmConfig", ("model_config", "ec_transfer_config", "parallel_config")),
    ("vllm.config", "ECTransferConfig",
     ("ec_connector", "ec_role", "ec_connector_module_path", "ec_connector_extra_config",
      "mm_encoder_output_widths")),
    ("vllm.config", "ModelConfig",
     ("model", "revision", "dtype", "multimodal_config", "is_multimodal_model",
      "get_hidden_size")),
    ("vllm.config", "ParallelConfig", ("tensor_parallel_size", "pipeline_parallel_size")),
    ("vllm.distributed.parallel_state", "GroupCoordinator",
     ("rank_in_group", "world_size", "cpu_group")),
    ("vllm.multimodal.encoder_budget", "MultiModalBudget",
     ("mm_max_toks_per_item", "get_dummy_encoder_profile_inputs")),
    # The width Job's encode timing, on the worker vLLM hands ``collective_rpc``.
    ("vllm.v1.worker.gpu_worker", "Worker", ("model_runner", "vllm_config")),
    ("vllm.model_executor.models.interfaces", "SupportsMultiModal", ("embed_multimodal",)),
    # (``current_device`` is torch.cuda's, which the platform object forwards to)
    ("vllm.platforms.interface", "Platform", ("device_type", "is_cuda_alike")),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Import:
    """One ``from vllm... import name`` (or ``import vllm...``) in our code."""

    module: str
    name: str | None
    where: str  # path:line

    def __str__(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module


def vllm_imports(root: Path = REPO) -> list[Import]:
    """Every vLLM name our in-pod code imports, at module level, in functions or for types."""
    found = []
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            where = str(path.relative_to(root))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    if node.module == "vllm" or node.module.startswith("vllm."):
                        found += [
                            Import(node.module, a.name, f"{where}:{node.lineno}")
                            for a in node.names
                        ]
                elif isinstance(node, ast.Import):
                    found += [
                        Import(a.name, None, f"{where}:{node.lineno}")
                        for a in node.names
                        if a.name == "vllm" or a.name.startswith("vllm.")
                    ]
    return found


def import_problems(imports: list[Import]) -> list[str]:
    """The imports that fail: a module gone, or a name no longer in its module."""
    problems = []
    for imp in imports:
        try:
            module = importlib.import_module(imp.module)
        except Exception as e:
            problems.append(f"{imp.where}: import {imp.module} fails: {type(e).__name__}: {e}")
            continue
        if imp.name is not None and not hasattr(module, imp.name):
            try:  # a submodule imported by name
                importlib.import_module(f"{imp.module}.{imp.name}")
            except ImportError:
                problems.append(f"{imp.where}: {imp.module} has no {imp.name} (moved or removed)")
    return problems


def resolve(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def has_member(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``: a class attribute, a (pydantic) dataclass
    field, an annotation, or an attribute its ``__init__`` sets."""
    if hasattr(cls, name):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    if name in getattr(cls, "model_fields", {}):
        return True
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=[^=]", source):
            return True
    return False


def member_problems(members: tuple[tuple[str, str, tuple[str, ...]], ...] = MEMBERS) -> list[str]:
    problems = []
    for module, name, wanted in members:
        try:
            cls = resolve(module, name)
        except Exception as e:
            problems.append(f"{module}.{name} is gone: {type(e).__name__}: {e}")
            continue
        problems += [
            f"{module}.{name} has no {attr} (the connector reads it)"
            for attr in wanted
            if not has_member(cls, attr)
        ]
    return problems


_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)


def call_problems(base: inspect.Signature, ours: inspect.Signature) -> list[str]:
    """Why a call that ``base``'s signature allows would not fit ``ours`` (empty: it fits).

    vLLM calls our override as its base method is declared: each positional parameter may
    come by position or by name, each keyword-only one by name, and nothing else."""
    theirs = list(base.parameters.values())
    mine = list(ours.parameters.values())
    my_positional = [p for p in mine if p.kind in _POSITIONAL]
    by_name = {p.name: p for p in mine}
    var_kw = any(p.kind is _P.VAR_KEYWORD for p in mine)
    var_pos = any(p.kind is _P.VAR_POSITIONAL for p in mine)
    problems = []
    for i, p in enumerate(p for p in theirs if p.kind in _POSITIONAL):
        if i < len(my_positional) and my_positional[i].name == p.name:
            continue
        if var_pos and (var_kw or p.kind is _P.POSITIONAL_ONLY):
            continue
        problems.append(f"takes no {p.name!r} as positional parameter {i}")
    for p in theirs:
        if p.kind is _P.KEYWORD_ONLY and not (
            var_kw or (p.name in by_name and by_name[p.name].kind is not _P.POSITIONAL_ONLY)
        ):
            problems.append(f"takes no keyword {p.name!r}")
        if p.kind is _P.VAR_POSITIONAL and not var_pos:
            problems.append("takes no *args")
        if p.kind is _P.VAR_KEYWORD and not var_kw:
            problems.append("takes no **kwargs")
    given = {p.name for p in theirs}
    problems += [
        f"requires {p.name!r}, which vLLM does not pass"
        for p in mine
        if p.default is _P.empty and p.kind not in (_P.VAR_KEYWORD, _P.VAR_POSITIONAL)
        and p.name not in given
    ]  # fmt: skip
    return problems


def returns(sig: inspect.Signature) -> str:
    """The return annotation as text: quotes, spaces and module paths dropped (vLLM writes
    some as strings, some as objects)."""
    ann = sig.return_annotation
    if ann is inspect.Signature.empty:
        return ""
    text = ann if isinstance(ann, str) else inspect.formatannotation(ann)
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_])", "", re.sub(r"[\s'\"]", "", text))


def _own_methods(cls: type, base: type) -> dict[str, tuple[type, Any]]:
    """The functions ``cls`` and its classes up to ``base`` define, by name (nearest first)."""
    own: dict[str, tuple[type, Any]] = {}
    for klass in cls.__mro__:
        if klass is base or issubclass(base, klass):
            break
        for name, value in vars(klass).items():
            raw = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            if inspect.isfunction(raw) and name not in own:
                own[name] = (klass, value)
    return own


def override_problems(cls: type, base: type, written_for: dict[str, str]) -> list[str]:
    """Where ``cls`` no longer fits ``base``: a method vLLM declares abstract that we do not
    define, a public method of ours that overrides nothing (vLLM renamed or removed it), an
    override that cannot take the calls the base method's parameters allow, or a base
    method whose return type is no longer the one in ``written_for`` (the connector's
    overrides return what vLLM's said when they were written)."""
    problems = []
    name = f"{cls.__module__}.{cls.__qualname__}"
    problems += [
        f"{base.__name__}.{m} is abstract in vLLM, and {name} does not define it"
        for m in sorted(getattr(cls, "__abstractmethods__", ()))
    ]
    for method, (owner, value) in sorted(_own_methods(cls, base).items()):
        if method.startswith("_") and not hasattr(base, method):
            continue  # our own helper
        where = f"{owner.__name__}.{method}"
        if not hasattr(base, method):
            problems.append(
                f"{where} overrides nothing: {base.__name__} has no {method} "
                "(vLLM renamed or removed it, so vLLM never calls ours)"
            )
            continue
        base_value = inspect.getattr_static(base, method)
        if isinstance(value, (classmethod, staticmethod)) != isinstance(
            base_value, (classmethod, staticmethod)
        ) or type(value) is not type(base_value):
            problems.append(
                f"{where} is a {type(value).__name__}, {base.__name__}.{method} a "
                f"{type(base_value).__name__}"
            )
            continue
        theirs = inspect.signature(getattr(base, method))
        mine = inspect.signature(getattr(cls, method))
        for problem in call_problems(theirs, mine):
            problems.append(
                f"{where}{mine} {problem}: vLLM declares {base.__name__}.{method}{theirs}"
            )
        expected = written_for.get(method)
        if expected is None:
            problems.append(f"{where}: no return type recorded for {base.__name__}.{method}")
        elif returns(theirs) != expected:
            problems.append(
                f"{base.__name__}.{method} now returns {returns(theirs)}, "
                f"{where} was written for {expected}"
            )
    return problems
