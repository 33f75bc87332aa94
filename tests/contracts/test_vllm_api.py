"""The connector's contract with vLLM, checked against the vLLM importable here: the
venv's 0.32 in the main suite, each supported release's own modules when
``test_vllm_releases`` runs this module with the release ahead on the path.

What is checked: every vLLM name our in-pod code imports; the members it reads on vLLM's
objects; that each connector class still fits ``ECConnectorBase`` (no abstract method left
undefined, every override still a base method, taking the calls the base declares, whose
return type is the one our override was written for); and the EC item metadata a
producer's ``collect_ec_item_metadata`` returns, which the connector extends and a
consumer reads back, with and without the ``modality`` key vLLM 0.33 added. A release
that moves any of it fails here, the message naming what moved."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from encoderpool_contracts import ANNOUNCE_KEY, Announcement, announce, raw_announcement
from tests.contracts import vllm_api

# The return types of the ECConnectorBase methods the connector overrides, as vLLM 0.32
# declares them (module paths dropped): what the overrides were written for.
WRITTEN_FOR = {
    "__init__": "",
    "build_connector_meta": "ECConnectorMetadata",
    "build_connector_worker_meta": "ECConnectorWorkerMetadata|None",
    "build_ec_connector_stats": "ECConnectorStats|None",
    "build_prom_metrics": "ECConnectorPromMetrics|None",
    "ensure_cache_available": "bool",
    "get_ec_connector_stats": "ECConnectorStats|None",
    "has_cache_item": "bool",
    "request_finished": "tuple[bool,dict[str,Any]|None]",
    "save_caches": "None",
    "shutdown": "None",
    "start_load_caches": "None",
    "start_save_caches": "None",
    "take_unavailable_requests": "set[str]",
    "update_connector_output": "",
    "update_state_after_alloc": "",
}
# The keys vLLM's item metadata may carry ("modality": from 0.33); ours sits beside them.
VLLM_ITEM_KEYS = {"item_indices", "metadata", "modality"}


def test_the_vllm_under_test_is_the_release_asked_for() -> None:
    """In a release's run, the modules imported are that release's, not the venv's 0.32."""
    import vllm

    release = os.environ.get("ENCODERPOOL_VLLM_RELEASE")
    folder = os.environ.get("ENCODERPOOL_VLLM_RELEASE_DIR")
    if release is None or folder is None:
        assert vllm.__version__.startswith("0.32."), vllm.__version__
        return
    assert vllm.__version__ == release
    assert Path(vllm.__file__).resolve().is_relative_to(Path(folder).resolve())


def test_every_vllm_name_the_connector_imports_exists() -> None:
    imports = vllm_api.vllm_imports()
    assert len(imports) > 30, "the scan found too few imports: has the layout moved?"
    problems = vllm_api.import_problems(imports)
    assert problems == [], "\n".join(problems)


def test_every_member_the_connector_reads_exists() -> None:
    problems = vllm_api.member_problems()
    assert problems == [], "\n".join(problems)


def test_the_width_job_s_encode_timing_reads_the_runner_as_vllm_s_width_measurement() -> None:
    """The model runner's class moves between releases (0.34: ``v1/worker/gpu/``), so its
    members are checked through vLLM's own width measurement, which the timing mirrors:
    what both read must still be read there."""
    import inspect

    from vllm.distributed.ec_transfer.ec_connector import encoder_output_width

    from encoderpool_connector.programs import encode_timing

    theirs = inspect.getsource(encoder_output_width._measure_on_worker)
    ours = inspect.getsource(encode_timing.time_encodes_on_worker)
    for used in (
        "worker.model_runner",
        "runner.supports_mm_inputs",
        "get_pp_group().is_first_rank",
        "runner.get_model()",
        "get_dummy_encoder_profile_inputs(modality, 1)",
        "device=runner.device, pin_memory=PIN_MEMORY",
        "model.embed_multimodal(**mm_kwargs)",
    ):
        assert used in ours, f"the timing no longer reads {used}: update this list"
        assert used in theirs, f"vLLM's width measurement no longer reads {used}"


@pytest.mark.parametrize(
    ("module", "name"), vllm_api.CONNECTORS, ids=[c[1] for c in vllm_api.CONNECTORS]
)
def test_each_connector_class_fits_ec_connector_base(module: str, name: str) -> None:
    base = vllm_api.resolve(*vllm_api.BASE)
    problems = vllm_api.override_problems(vllm_api.resolve(module, name), base, WRITTEN_FOR)
    assert problems == [], "\n".join(problems)


def _features() -> list[Any]:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    def feature(mm_hash: str, modality: str, offset: int) -> Any:
        return MultiModalFeatureSpec(
            data=None,
            modality=modality,
            identifier=mm_hash,
            mm_position=PlaceholderRange(offset=offset, length=4),
        )

    # The same image twice: one item, two indices.
    return [
        feature("a" * 16, "image", 0),
        feature("b" * 16, "video", 8),
        feature("a" * 16, "image", 20),
    ]


class _NoFields:
    """A resolver for a model that publishes no placeholder fields."""

    def fields_for(self, modality: str) -> set[str]:
        return set()


def test_collect_ec_item_metadata_gives_the_items_the_connector_extends() -> None:
    from vllm.distributed.ec_transfer.ec_connector.utils import collect_ec_item_metadata

    items = collect_ec_item_metadata(_features(), _NoFields())
    assert set(items) == {"a" * 16, "b" * 16}
    for mm_hash, item in items.items():
        assert isinstance(item, dict), f"vLLM's item for {mm_hash} is a {type(item).__name__}"
        assert {"item_indices", "metadata"} <= set(item) <= VLLM_ITEM_KEYS, (
            f"vLLM's item metadata keys are now {sorted(item)}, the connector knows "
            f"{sorted(VLLM_ITEM_KEYS)}"
        )
        assert ANNOUNCE_KEY not in item
    assert items["a" * 16]["item_indices"] == [0, 2]
    if "modality" in items["a" * 16]:
        assert items["a" * 16]["modality"] == "image"
        assert items["b" * 16]["modality"] == "video"


@pytest.mark.parametrize("with_modality", [False, True], ids=["0.32-items", "modality-items"])
def test_the_consumer_reads_our_announcement_from_either_shape(with_modality: bool) -> None:
    """Producer: vLLM's items plus our announcement; the router passes them on as JSON; the
    consumer reads each item's announcement back (what its scheduler does)."""
    from vllm.distributed.ec_transfer.ec_connector.utils import collect_ec_item_metadata

    items = collect_ec_item_metadata(_features(), _NoFields())
    for item in items.values():
        if with_modality:
            item.setdefault("modality", "image")
        else:
            item.pop("modality", None)
    sent = Announcement(fingerprint="0123456789abcdef")
    for item in items.values():
        announce(item, sent)
    params = json.loads(json.dumps(items))
    for mm_hash in items:
        assert Announcement.parse(raw_announcement(params, mm_hash)) == sent
        assert ("modality" in params[mm_hash]) == with_modality
