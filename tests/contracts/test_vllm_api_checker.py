"""The checker behind test_vllm_api, on small stand-ins for vLLM's base class: each change
a release could make is found and named (no vLLM needed)."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any

from tests.contracts.vllm_api import call_problems, has_member, override_problems


class Base(ABC):
    def __init__(self, config: Any, role: int) -> None:
        self.role = role

    @abstractmethod
    def save_caches(self, encoder_cache: dict[str, Any], mm_hash: str, **kwargs: Any) -> None: ...

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    @classmethod
    def build_stats(cls, data: dict[str, Any] | None = None) -> Any | None:
        return None


class Ours(Base):
    def save_caches(self, encoder_cache: dict[str, Any], mm_hash: str, **kwargs: Any) -> None:
        pass

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    @classmethod
    def build_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return None

    def _helper(self) -> None:
        pass


WRITTEN_FOR = {
    "__init__": "",
    "save_caches": "None",
    "request_finished": "tuple[bool,dict[str,Any]|None]",
    "build_stats": "Any|None",
}


def test_a_fitting_subclass_has_no_problems() -> None:
    assert override_problems(Ours, Base, WRITTEN_FOR) == []


def test_a_renamed_base_method_is_named() -> None:
    class Moved:  # request_finished renamed, the rest as before
        def __init__(self, config: Any, role: int) -> None:
            pass

        def save_caches(self, encoder_cache: Any, mm_hash: str, **kwargs: Any) -> None:
            pass

        def on_request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
            return False, None

        @classmethod
        def build_stats(cls, data: dict[str, Any] | None = None) -> Any | None:
            return None

    class OursOnMoved(Moved):
        request_finished = Ours.request_finished
        save_caches = Ours.save_caches
        build_stats = Ours.__dict__["build_stats"]

    problems = override_problems(OursOnMoved, Moved, WRITTEN_FOR)
    assert len(problems) == 1
    assert "request_finished overrides nothing: Moved has no request_finished" in problems[0]


def test_a_new_abstract_method_a_new_parameter_and_a_new_return_type_are_named() -> None:
    class Newer(Base):
        @abstractmethod
        def take_unavailable(self) -> set[str]: ...

        def request_finished(  # type: ignore[override]
            self, request: Any, reason: str
        ) -> dict[str, Any]:
            return {}

    class OursOnNewer(Newer):
        save_caches = Ours.save_caches
        request_finished = Ours.request_finished  # type: ignore[assignment]

    problems = override_problems(OursOnNewer, Newer, WRITTEN_FOR)
    assert any("take_unavailable is abstract in vLLM" in p for p in problems), problems
    assert any("takes no 'reason' as positional parameter 2" in p for p in problems), problems
    assert any(
        "request_finished now returns dict[str,Any]" in p
        and "written for tuple[bool,dict[str,Any]|None]" in p
        for p in problems
    ), problems


def sig(f: Any) -> inspect.Signature:
    return inspect.signature(f)


def test_calls_the_base_allows_must_fit_the_override() -> None:
    def base(self: Any, a: int, *, b: int = 0) -> None: ...

    def same(self: Any, a: int, *, b: int = 0) -> None: ...

    def kwargs(self: Any, a: int, **kw: Any) -> None: ...

    def renamed(self: Any, x: int, *, b: int = 0) -> None: ...

    def no_b(self: Any, a: int) -> None: ...

    def extra_required(self: Any, a: int, c: int, *, b: int = 0) -> None: ...

    assert call_problems(sig(base), sig(same)) == []
    assert call_problems(sig(base), sig(kwargs)) == []
    assert call_problems(sig(base), sig(renamed)) == [
        "takes no 'a' as positional parameter 1",
        "requires 'x', which vLLM does not pass",
    ]
    assert call_problems(sig(base), sig(no_b)) == ["takes no keyword 'b'"]
    assert call_problems(sig(base), sig(extra_required)) == [
        "requires 'c', which vLLM does not pass"
    ]


def test_members_are_found_where_classes_declare_them() -> None:
    class Plain:
        def __init__(self) -> None:
            self.request_id = "r"

    assert has_member(Plain, "request_id")
    assert not has_member(Plain, "mm_features")
