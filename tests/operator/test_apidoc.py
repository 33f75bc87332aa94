"""docs/api.md's field reference and rules table are what the models generate, and they
cover every field and every rule (so the page never lags the CRD)."""

from __future__ import annotations

from pathlib import Path

import pytest

from encoderpool_codegen import apidoc
from encoderpool_operator import api
from tests.operator.api_cases import rules

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "api.md"


def test_committed_page_equals_a_regeneration() -> None:
    text = PAGE.read_text()
    assert apidoc.render(text) == text, "stale docs/api.md: run `make crds` and commit it"


def test_check_mode_reports_a_stale_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "api.md"
    page.write_text(PAGE.read_text())
    assert apidoc.main(["--check", str(page)]) == 0
    page.write_text(page.read_text().replace("| `maxReplicas` |", "| `maxReplica` |", 1))
    assert apidoc.main(["--check", str(page)]) == 1
    assert "+| `maxReplicas` |" in capsys.readouterr().out
    assert apidoc.main([str(page)]) == 0
    assert page.read_text() == PAGE.read_text()


def test_prose_outside_the_markers_is_kept() -> None:
    text = PAGE.read_text()
    assert apidoc.render("intro\n" + text + "outro\n") == "intro\n" + text + "outro\n"


def test_missing_markers_are_an_error() -> None:
    with pytest.raises(ValueError, match="fields begin"):
        apidoc.render("no markers here\n")


@pytest.mark.parametrize("model", [api.EncoderPoolSpec, api.EncoderPoolStatus])
def test_every_field_has_a_row(model: type[api.ApiModel]) -> None:
    fields = apidoc.fields_block()
    seen: set[type[api.ApiModel]] = set()

    def walk(m: type[api.ApiModel]) -> None:
        if m in seen:
            return
        seen.add(m)
        section = fields.split(f"### {m.__name__}\n", 1)[1].split("\n### ", 1)[0]
        for name, info in m.model_fields.items():
            assert f"| `{info.alias or name}` |" in section, (m.__name__, name)
            for inner in apidoc._models_in(info.annotation):
                walk(inner)

    walk(model)


def test_status_autoscaling_and_encode_seconds_are_documented() -> None:
    fields = apidoc.fields_block()
    assert "### AutoscalerStatus" in fields
    assert "| `encodeSeconds` |" in fields
    assert "| `autoscaling` | [Autoscaling](#autoscaling) |" in fields


def test_every_rule_has_a_row() -> None:
    table = apidoc.rules_block()
    for _, rule in rules():
        assert apidoc._cell(rule.message) in table, rule.message
