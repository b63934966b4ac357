"""The `pdserve` CLI: `generate` streams one prompt, batches several, and fails in one clean line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdserve.cli import app

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fixtures.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("cli") / "tiny", seed=3)


def _invoke(*args: str):
    return CliRunner().invoke(app, ["generate", *args], catch_exceptions=False)


def test_generate_streams_one_prompt(model_dir: Path) -> None:
    res = _invoke(
        "--model", str(model_dir), "--prompt", "def fibonacci(n):", "--max-new-tokens", "6", "--temperature", "0"
    )
    assert res.exit_code == 0, res.output
    assert res.stdout.strip()  # random weights: some text, whatever it is
    assert "6 tokens in" in res.stderr and "finish: length" in res.stderr


def test_generate_is_deterministic_with_seed(model_dir: Path) -> None:
    args = ("--model", str(model_dir), "-p", "hello", "--max-new-tokens", "8", "--seed", "7")
    first, second = _invoke(*args), _invoke(*args)
    assert first.exit_code == second.exit_code == 0
    assert first.stdout == second.stdout


def test_generate_batches_two_prompts(model_dir: Path) -> None:
    res = _invoke(
        "--model", str(model_dir), "-p", "hello", "-p", "world", "--max-new-tokens", "4", "--temperature", "0"
    )
    assert res.exit_code == 0, res.output
    assert "--- [0] 'hello' (4 tokens, length)" in res.stdout
    assert "--- [1] 'world' (4 tokens, length)" in res.stdout
    assert "8 tokens in" in res.stderr


def test_generate_chat_and_stop_string(model_dir: Path) -> None:
    res = _invoke("--model", str(model_dir), "-p", "hi", "--chat", "--max-new-tokens", "4", "--stop", "\x00never")
    assert res.exit_code == 0, res.output
    assert "finish:" in res.stderr


def test_missing_model_dir_is_a_clean_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    res = _invoke("--model", str(missing), "-p", "hi")
    assert res.exit_code == 2
    assert str(missing) in res.stderr
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1
    assert "Traceback" not in res.output


@pytest.mark.parametrize(
    "option, value, field",
    [
        ("--temperature", "-1", "temperature"),
        ("--top-p", "0", "top_p"),
        ("--dtype", "int8", "dtype"),
        ("--page-size", "0", "page_size"),
        ("--device", "tpu", "--device"),
    ],
)
def test_bad_options_are_clean_errors(model_dir: Path, option: str, value: str, field: str) -> None:
    res = _invoke("--model", str(model_dir), "-p", "hi", option, value)
    assert res.exit_code == 2
    assert field in res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.output


def test_version_needs_no_subcommand() -> None:
    from pdserve import __version__

    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.strip() == __version__


def test_module_help_runs_and_import_stays_torch_free() -> None:
    help_run = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert help_run.returncode == 0, help_run.stderr
    assert "generate" in help_run.stdout
    # Both the package and the CLI module: `pdserve --help` and the router must not pay for torch.
    probe = "import sys, pdserve, pdserve.cli; print('torch' in sys.modules, 'engine' in sys.modules)"
    imp = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert imp.returncode == 0, imp.stderr
    assert imp.stdout.split() == ["False", "False"]


# ---- speculative decoding flags ----


@pytest.fixture(scope="module")
def eagle_head(model_dir: Path) -> Path:
    from fixtures.tiny_eagle import write_tiny_eagle_head

    # A random head: its drafts are almost always rejected, so nearly every verify falls back
    # to the target's own token, the path where an off-by-one would show in the text.
    return write_tiny_eagle_head(model_dir.parent / "eagle-head", model_dir, "eagle", mode="random")


def _greedy(model_dir: Path, *extra: str, prompts: tuple[str, ...] = ("def fibonacci(n):",)):
    args = [a for p in prompts for a in ("-p", p)]
    return _invoke("--model", str(model_dir), *args, "--max-new-tokens", "12", "--temperature", "0", *extra)


@pytest.mark.parametrize("prompts", [("def fibonacci(n):",), ("hello", "for i in range(10):")], ids=["stream", "batch"])
def test_eagle_greedy_text_equals_plain(model_dir: Path, eagle_head: Path, prompts: tuple[str, ...]) -> None:
    plain = _greedy(model_dir, prompts=prompts)
    # lower case on purpose: algorithm names are case-insensitive
    spec = _greedy(
        model_dir,
        "--speculative-algorithm",
        "eagle",
        "--speculative-draft-model-path",
        str(eagle_head),
        prompts=prompts,
    )
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    assert "speculative EAGLE:" in spec.stderr
    assert "mean accepted length" in spec.stderr and "acceptance rate" in spec.stderr
    assert "speculative" not in plain.stderr


def test_ngram_greedy_text_equals_plain(model_dir: Path) -> None:
    from spec.registry import registered_names

    if "NGRAM" not in registered_names():
        pytest.skip("the NGRAM plugin is not registered (entry point not installed)")
    prompts = ("a b a b a b a b", "x = x + 1\nx = x + 1\n")
    plain = _greedy(model_dir, prompts=prompts)
    spec = _greedy(model_dir, "--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3", prompts=prompts)
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    assert "speculative NGRAM:" in spec.stderr


def _assert_clean_error(res, *needles: str) -> None:
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    assert "Traceback" not in res.output
    for needle in needles:
        assert needle in res.stderr


def test_unknown_algorithm_lists_known_names(model_dir: Path) -> None:
    res = _greedy(model_dir, "--speculative-algorithm", "medusa9")
    _assert_clean_error(res, "MEDUSA9", "EAGLE", "EAGLE3", "NONE")


def test_eagle_without_draft_path_names_the_flag(model_dir: Path) -> None:
    res = _greedy(model_dir, "--speculative-algorithm", "EAGLE")
    _assert_clean_error(res, "--speculative-draft-model-path")


def test_chain_with_wrong_num_draft_tokens_names_the_flag(model_dir: Path, eagle_head: Path) -> None:
    res = _greedy(
        model_dir,
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-draft-model-path",
        str(eagle_head),
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "3",
    )
    _assert_clean_error(res, "--speculative-num-draft-tokens")


def test_bad_draft_dir_is_a_clean_error(model_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "not-a-head"
    empty.mkdir()
    res = _greedy(model_dir, "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(empty))
    _assert_clean_error(res, str(empty))


def test_spec_flags_without_algorithm_are_refused(model_dir: Path) -> None:
    # Ignoring them silently would let a user believe speculation ran.
    res = _greedy(model_dir, "--speculative-num-steps", "2")
    _assert_clean_error(res, "--speculative-num-steps", "--speculative-algorithm")


def test_flags_take_sglang_aliases_and_pdserve_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every flag comes from a config field: SGLang's names work, and PDSERVE_<FLAG> sets it."""
    from common.config import DecodeRole, EngineOptions, PrefillRole, SpeculativeOptions
    from pdserve import node_cli

    seen: dict[str, object] = {}
    monkeypatch.setattr(
        node_cli,
        "_run",
        lambda role, engine, spec, *rest, **kw: seen.update(role=role, engine=engine, spec=spec, rest=rest, kw=kw),
    )
    monkeypatch.setenv("PDSERVE_SPECULATIVE_NGRAM_MAX", "7")
    monkeypatch.setenv("PDSERVE_KV_SEND_CHUNKS", "false")
    monkeypatch.setenv("PDSERVE_DISABLE_MIXED_CHUNK", "true")  # how the goodput bench turns it off
    res = CliRunner().invoke(
        app,
        [
            "prefill",
            "--model-path",
            "/m",
            "--served-model-name",
            "pycoder",
            "--max-running-requests",
            "5",
            "--disaggregation-bootstrap-port",
            "9001",
            "--disaggregation-transfer-backend",
            "fake",
            "--speculative-algorithm",
            "NGRAM",
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    engine, spec = seen["engine"], seen["spec"]
    assert isinstance(engine, EngineOptions) and isinstance(spec, SpeculativeOptions)
    assert (str(engine.model), engine.served_model_name, engine.max_running) == ("/m", "pycoder", 5)
    assert engine.disable_mixed_chunk and not EngineOptions().disable_mixed_chunk
    assert (spec.algorithm, spec.ngram_max) == ("NGRAM", 7)
    role = seen["role"]
    assert (role.bootstrap_port, role.transport, role.send_chunks) == (9001, "fake", False)
    assert role.sgl == "auto"  # batched writes where the KV is in GPU memory
    assert not role.local_decode and seen["kw"] == {"tpot_guard_ms": None}  # whole requests refused by default
    assert PrefillRole().bootstrap_port == 8998 and DecodeRole().port == 30002


def test_api_keys_come_from_a_comma_separated_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    """PDSERVE_API_KEY=key1,key2 (the chart's Secret) gives the router both keys; --api-key wins."""
    import router.main

    seen: list[object] = []

    async def fake_run_router(cfg: object) -> None:
        seen.append(cfg)

    monkeypatch.setattr(router.main, "run_router", fake_run_router)
    monkeypatch.setenv("PDSERVE_API_KEY", "key1, key2")
    assert CliRunner().invoke(app, ["router"], catch_exceptions=False).exit_code == 0
    assert CliRunner().invoke(app, ["router", "--api-key", "k3"], catch_exceptions=False).exit_code == 0
    assert [c.api_keys for c in seen] == [frozenset({"key1", "key2"}), frozenset({"k3"})]


@pytest.mark.parametrize("command", ["serve", "prefill", "decode", "router"])
@pytest.mark.parametrize("flag, value", [("--log-level", "loud"), ("--log-format", "xml")])
def test_bad_log_settings_are_clean_errors(command: str, flag: str, value: str) -> None:
    """Refused before anything loads or binds, naming the flag."""
    res = CliRunner().invoke(app, [command, flag, value])
    _assert_clean_error(res, flag, value)


def test_up_passes_the_log_options_to_every_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pdserve up --log-format json` gives nodes and router the same logging flags."""
    import pdserve.up as up

    seen: dict[str, object] = {}

    class FakeDeployment:
        def __init__(self, cfg: object) -> None:
            seen["cfg"] = cfg

        def start(self, progress: object) -> str:
            raise RuntimeError("stop here")

        def stop(self) -> None:
            pass

    monkeypatch.setattr(up, "Deployment", FakeDeployment)
    res = CliRunner().invoke(app, ["up", "--log-format", "json", "--log-level", "debug"])
    assert res.exit_code == 1 and "stop here" in res.output
    assert seen["cfg"].log_args == ("--log-level", "debug", "--log-format", "json")  # type: ignore[attr-defined]


def test_up_isolates_gpus_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each node sees only its GPU by default; --no-isolate-gpus lets PD nodes see each other's."""
    import pdserve.up as up

    seen: list[bool] = []

    class FakeDeployment:
        def __init__(self, cfg: up.UpConfig) -> None:
            seen.append(cfg.isolate_gpus)

        def start(self, progress: object) -> str:
            raise RuntimeError("stop here")

        def stop(self) -> None:
            pass

    monkeypatch.setattr(up, "Deployment", FakeDeployment)
    for args in (["up"], ["up", "--no-isolate-gpus"]):
        assert CliRunner().invoke(app, args).exit_code == 1
    assert seen == [True, False]


def test_a_node_takes_its_stream_interval_from_the_flag_or_its_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--stream-interval` (auto by default) and its budget reach the node's streams
    (`set_stream_interval`); a bad value is one line, exit 2."""
    from engine.service import stream

    seen: list[tuple[str, float]] = []

    def refuse(setting: str, messages_per_s: float) -> None:  # as a bad value would be: before any model load
        seen.append((setting, messages_per_s))
        raise ValueError("--stream-interval refused here")

    monkeypatch.setattr(stream, "set_stream_interval", refuse)
    monkeypatch.setenv("PDSERVE_STREAM_INTERVAL", "4")
    result = CliRunner().invoke(app, ["serve", "--model", "/nonexistent", "--device", "cpu"])
    assert seen == [("4", 3000.0)] and result.exit_code == 2, result.output
    monkeypatch.delenv("PDSERVE_STREAM_INTERVAL")
    args = ["serve", "--model", "/nonexistent", "--device", "cpu", "--stream-messages-per-s", "500"]
    assert CliRunner().invoke(app, args).exit_code == 2
    assert seen[-1] == ("auto", 500.0)


def test_a_node_sets_its_gil_switch_interval_when_told() -> None:
    import sys

    from pdserve.node_cli import set_switch_interval

    before = sys.getswitchinterval()
    try:
        set_switch_interval(None)
        assert sys.getswitchinterval() == before  # Python's own unless told
        set_switch_interval(0.5)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        with pytest.raises(ValueError, match="--switch-interval-ms must be > 0"):
            set_switch_interval(0)
    finally:
        sys.setswitchinterval(before)
