"""Algorithm registry: lookup, plugin registration checks, old hook names, entry-point discovery."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

import spec.registry as registry
from spec.config import SpecConfig
from spec.ngram import NgramAlgo
from spec.registry import (
    CustomSpecAlgo,
    SpeculativeAlgorithm,
    SpecRegistryError,
    bind,
    register,
    register_class,
    registered_names,
)


@pytest.fixture
def names():
    """Names registered by a test; unregistered afterwards so tests stay independent."""
    added: list[str] = []
    yield added
    for name in added:
        registry.unregister(name)


class _Minimal(CustomSpecAlgo):
    def create_worker(self, parts, config):
        raise NotImplementedError


class _Other(CustomSpecAlgo):
    def create_worker(self, parts, config):
        raise NotImplementedError


@pytest.mark.parametrize(
    "name,algo",
    [
        ("none", "NONE"),
        ("None", "NONE"),
        (None, "NONE"),
        ("eagle", "EAGLE"),
        ("Eagle3", "EAGLE3"),
    ],
)
def test_builtins_are_found_case_insensitively(name, algo):
    assert SpeculativeAlgorithm.from_name(name) is getattr(SpeculativeAlgorithm, algo)
    assert SpeculativeAlgorithm.from_name(name).name == algo


def test_plugin_is_found_case_insensitively():
    for name in ("ngram", "NGRAM", "NGram"):
        assert isinstance(SpeculativeAlgorithm.from_name(name), NgramAlgo)
    assert SpeculativeAlgorithm.from_name("ngram") is SpeculativeAlgorithm.from_name("NGRAM")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(SpecRegistryError, match="unknown speculative algorithm 'medusa'") as e:
        SpeculativeAlgorithm.from_name("medusa")
    for known in ("NONE", "EAGLE", "EAGLE3", "NGRAM"):
        assert known in str(e.value)


def test_entry_point_plugin_is_discovered_after_install():
    eps = {ep.name: ep.value for ep in entry_points(group=registry.ENTRY_POINT_GROUP)}
    assert eps.get("NGRAM") == "spec.ngram:NgramAlgo"
    algo = SpeculativeAlgorithm.from_name("ngram")
    assert isinstance(algo, NgramAlgo) and algo.name == "NGRAM"
    assert "NGRAM" in registered_names()


@pytest.mark.parametrize("name", ["NONE", "EAGLE", "eagle3", "NEXTN"])
def test_reserved_names_are_refused(name):
    with pytest.raises(SpecRegistryError, match="reserved"):
        register_class(name, _Minimal)


@pytest.mark.parametrize("name", ["", "my-algo", "a b"])
def test_invalid_names_are_refused(name):
    with pytest.raises(SpecRegistryError, match="invalid algorithm name"):
        register_class(name, _Minimal)


def test_duplicates_are_refused_and_same_class_is_idempotent(names):
    names.append("TEST_DUP")
    first = register_class("TEST_DUP", _Minimal)
    assert register_class("test_dup", _Minimal) is first  # re-importing the plugin module
    assert SpeculativeAlgorithm.from_name("Test_Dup") is first
    with pytest.raises(SpecRegistryError, match="already registered by _Minimal"):
        register_class("TEST_DUP", _Other)
    SpeculativeAlgorithm.from_name("ngram")  # make sure the entry points are loaded
    with pytest.raises(SpecRegistryError, match="already registered by NgramAlgo"):
        register_class("NGRAM", _Other)


def test_decorator_registers_and_unregister_forgets(names):
    names.append("TEST_DECO")

    @register("test_deco")
    class Deco(CustomSpecAlgo):
        def create_worker(self, parts, config):
            raise NotImplementedError

    assert isinstance(SpeculativeAlgorithm.from_name("TEST_DECO"), Deco)
    registry.unregister("test_deco")
    with pytest.raises(SpecRegistryError, match="unknown"):
        SpeculativeAlgorithm.from_name("TEST_DECO")


def test_class_not_subclassing_custom_spec_algo_is_refused():
    class NotAPlugin:
        def create_worker(self, parts, config):
            raise NotImplementedError

    with pytest.raises(SpecRegistryError, match="subclass of CustomSpecAlgo"):
        register_class("TEST_NOT_A_PLUGIN", NotAPlugin)
    with pytest.raises(SpecRegistryError, match="subclass of CustomSpecAlgo"):
        register_class("TEST_BUILTIN_SUBCLASS", type(SpeculativeAlgorithm.EAGLE))


def test_incomplete_plugin_is_refused_naming_the_missing_hook():
    class Incomplete(CustomSpecAlgo):
        def needs_draft_model(self) -> bool:
            return False

    with pytest.raises(SpecRegistryError, match="create_worker") as e:
        register_class("TEST_INCOMPLETE", Incomplete)
    assert "Incomplete" in str(e.value)
    with pytest.raises(SpecRegistryError, match="unknown"):
        SpeculativeAlgorithm.from_name("TEST_INCOMPLETE")  # nothing half-registered


def test_old_verify_width_hook_name_is_forwarded_with_a_warning(names):
    class OldStyle(CustomSpecAlgo):
        def get_num_tokens_per_bs_for_target_verify(self, num_draft_tokens, is_draft_worker):
            return num_draft_tokens + (0 if is_draft_worker else 1)

        def create_worker(self, parts, config):
            raise NotImplementedError

    names.append("TEST_OLD_STYLE")
    algo = register_class("TEST_OLD_STYLE", OldStyle)
    with pytest.deprecated_call(match="get_num_tokens_per_req_for_target_verify"):
        assert algo.get_num_tokens_per_req_for_target_verify(4, False) == 5
    with pytest.deprecated_call():
        assert algo.get_num_tokens_per_req_for_target_verify(4, True) == 4


def test_extension_point_defaults_are_eagles(names):
    names.append("TEST_DEFAULTS")
    algo = register_class("TEST_DEFAULTS", _Minimal)
    eagle = SpeculativeAlgorithm.EAGLE
    for a in (algo, eagle):
        assert a.supports_target_verify_for_draft() is False
        assert a.get_num_tokens_per_req_for_target_verify(4, False) == 4
        assert a.carries_draft_hidden_states() is True
    assert algo.is_speculative() and algo.needs_draft_model()
    fm = algo.create_future_map(4, 2048, 1024, "cpu")
    assert fm.need_topk and fm.need_hidden and fm.num_rows == 5


def test_bind_needs_a_draft_path_for_eagle():
    with pytest.raises(SpecRegistryError, match="EAGLE needs --speculative-draft-model-path"):
        bind(SpecConfig("eagle"))
    with pytest.raises(SpecRegistryError, match="unknown speculative algorithm"):
        bind(SpecConfig("medusa"))
    assert callable(bind(SpecConfig("ngram")).create_worker)  # n-gram needs no draft model


def test_draft_model_dir_names_only_a_draft_that_keeps_kv(tmp_path):
    """What the engine sizes the KV cache for besides the target (engine/kv_budget.py)."""
    assert bind(SpecConfig("EAGLE", str(tmp_path), 3, 1)).draft_model_dir() == str(tmp_path)
    assert bind(SpecConfig("NONE")).draft_model_dir() is None
