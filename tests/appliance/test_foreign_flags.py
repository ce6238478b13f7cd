"""vLLM's and SGLang's launch flags (flag_aliases.FOREIGN_FLAGS): the Qwen3.5 model card's two
commands parse to the config they mean; flags that change nothing here give one INFO line each;
values asking for what this appliance cannot do are one error line; both `--flag value` and
`--flag=value`; one setting given two ways must agree; the offline LLM reads the same table."""

from __future__ import annotations

import shlex

import pytest

from appliance.cli import _serve_config, build_parser, main
from appliance.config import ServeConfig
from appliance.offline import options as offline_options
from appliance.offline.options import vllm_keywords
from tests.e2e.live import free_port

VLLM_CARD = (
    "serve Qwen/Qwen3.5-27B --port 8000 --tensor-parallel-size 8 --max-model-len 262144 "
    "--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser qwen3_coder "
    """--speculative-config '{"method":"qwen3_next_mtp","num_speculative_tokens":2}'"""
)
SGLANG_CARD = (
    "serve --model-path Qwen/Qwen3.5-27B --port 8000 --tp-size 8 --mem-fraction-static 0.8 "
    "--context-length 262144 --reasoning-parser qwen3 --tool-call-parser qwen3_coder "
    "--speculative-algo NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens 4"
)
TOOLS_NOTE = "--tool-call-parser qwen3_coder: ignored: tool calls are always parsed"


def _serve(argv: list[str] | str) -> tuple[ServeConfig, list[str]]:
    argv = shlex.split(argv) if isinstance(argv, str) else argv
    parser, dests = build_parser()
    return _serve_config(parser.parse_args(argv), dests)


def _refused(argv: list[str], capsys) -> str:
    """The one error line `appliance serve` exits 2 with, before anything starts."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_the_vllm_model_card_command():
    config, notes = _serve(VLLM_CARD)
    assert config.engine.model.model_dir == "Qwen/Qwen3.5-27B" and config.server.port == 8000
    assert config.engine.parallel.tp == 8 and config.engine.model.max_model_len == 262144
    assert config.engine.scheduler.mtp_step == 2 and config.engine.scheduler.mtp_mode == "eagle"
    assert config.server.reasoning == "on" and config.engine.scheduler.prefix_caching
    assert len(notes) == 2 and notes[0].startswith(TOOLS_NOTE)
    assert notes[1].startswith("--enable-auto-tool-choice: ignored: tool_choice auto")


def test_the_sglang_model_card_command():
    """--mem-fraction-static is read as vLLM's --gpu-memory-utilization (a share of the whole
    device)."""
    config, notes = _serve(SGLANG_CARD)
    assert config.engine.model.model_dir == "Qwen/Qwen3.5-27B" and config.server.port == 8000
    assert config.engine.parallel.tp == 8 and config.engine.model.max_model_len == 262144
    assert config.engine.scheduler.mtp_step == 3
    assert config.engine.cache.gpu_memory_utilization == 0.8
    assert config.server.reasoning == "on"
    assert len(notes) == 1 and notes[0].startswith(TOOLS_NOTE)


IMAGES = "server.visual.max_images_per_request"
MTP_STEP = "engine.scheduler.mtp_step"


@pytest.mark.parametrize(
    ("argv", "where", "value"),
    [
        ("--enable-prefix-caching", "engine.scheduler.prefix_caching", True),
        ("--enable-priority-scheduling", "engine.scheduler.scheduling_policy", "priority"),
        ("--scheduling-policy priority", "engine.scheduler.scheduling_policy", "priority"),
        ("--no-enable-prefix-caching", "engine.scheduler.prefix_caching", False),
        ("--disable-radix-cache", "engine.scheduler.prefix_caching", False),
        ("--context-length 4096", "engine.model.max_model_len", 4096),
        ("--max-running-requests 8", "engine.scheduler.max_num_seqs", 8),
        ("--chunked-prefill-size 8192", "engine.scheduler.max_num_batched_tokens", 8192),
        ("--language-model-only", "server.visual.vision", False),
        ("""--limit-mm-per-prompt '{"image": 3, "video": 0}'""", IMAGES, 3),
        ("""--limit-mm-per-prompt '{"image": {"count": 4}}'""", IMAGES, 4),
        ("""--limit-mm-per-prompt '{"image": 0, "video": 0}'""", "server.visual.vision", False),
        ("--limit-mm-per-prompt.video 0 --limit-mm-per-prompt.image 2", IMAGES, 2),
        ("--reasoning-parser deepseek-r1", "server.reasoning", "on"),
        ("""--speculative-config '{"method": "mtp"}'""", MTP_STEP, 1),
        (
            """--speculative-config '{"method": "qwen3_5_mtp", "num_speculative_tokens": 3}'""",
            MTP_STEP,
            3,
        ),
        (
            "--speculative-config.method mtp --speculative-config.num_speculative_tokens 2",
            MTP_STEP,
            2,
        ),
        (
            """--speculative-config '{"method": "mtp", "disable_by_batch_size": 8}'""",
            "engine.scheduler.mtp_disable_batch_size",
            8,
        ),
        ("--speculative-algorithm EAGLE --speculative-num-steps 1", MTP_STEP, 1),
        (
            "--speculative-algorithm nextn --speculative-num-steps 2 --speculative-eagle-topk 1",
            MTP_STEP,
            2,
        ),
        ("--model-path /n", "engine.model.model_dir", "/n"),
    ],
)
def test_flags_translated_to_ours(argv, where, value):
    config, notes = _serve(f"serve {argv}" if "--model" in argv else f"serve /m {argv}")
    for name in where.split("."):
        config = getattr(config, name)
    assert config == value and notes == []


def test_both_spellings_and_a_flag_given_twice():
    for argv in (
        ["--context-length", "4096"],
        ["--speculative-config", '{"method":"mtp","num_speculative_tokens":2}'],
        ["--reasoning-parser", "qwen3"],
    ):
        assert _serve(["serve", "/m", *argv]) == _serve(["serve", "/m", "=".join(argv)])
    config, _ = _serve("serve /m --context-length 100 --context-length 200")  # as argparse: last
    assert config.engine.model.max_model_len == 200


def test_flags_that_change_nothing_log_one_info_line_each():
    argv = (
        "serve /m --enable-auto-tool-choice --tool-call-parser hermes --enable-chunked-prefill "
        "--no-async-scheduling --trust-remote-code --enable-metrics --mm-enable-dp-encoder "
        "--mm-encoder-tp-mode data --mm-processor-cache-type shm --swap-space 4 "
        "--disable-log-requests --enable-log-requests --log-requests --disable-log-stats "
        "--log-level debug --uvicorn-log-level warning --chunked-prefill-size -1 "
        "--enable-prompt-tokens-details --enable-request-id-headers --enable-log-outputs "
        "--enable-expert-parallel --mamba-ssm-cache-dtype float32 --mamba-cache-dtype auto "
        "--compilation-config {} --block-size 16 --max-logprobs 20 "
        "--guided-decoding-backend xgrammar --chat-template-content-format openai "
        "--root-path /api --data-parallel-size 1 --pipeline-parallel-size 1 --cpu-offload-gb 0"
    )
    config, notes = _serve(argv)
    assert config == _serve("serve /m")[0]
    flags = [word for word in shlex.split(argv) if word.startswith("--")]
    assert sorted(note.partition(" ")[0].rstrip(":") for note in notes) == sorted(flags)
    assert all(": ignored: " in note for note in notes)
    assert "--log-level debug: ignored: the log level is APPLIANCE_LOG_LEVEL, read by every " in (
        "\n".join(notes)
    )
    assert "--no-async-scheduling: ignored: always on" in "\n".join(notes)
    assert "--chunked-prefill-size -1: ignored: --max-num-batched-tokens" in "\n".join(notes)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            """--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'""",
            "--speculative-config: method 'ngram' not supported: only the checkpoint's own MTP "
            "head drafts here (mtp, qwen3_next_mtp, qwen3_5_mtp)",
        ),
        (
            """--speculative-config '{"method": "eagle3", "model": "x/y"}'""",
            "--speculative-config: model not taken: drafts come from the checkpoint's own MTP "
            "head; the keys taken are method (mtp, qwen3_next_mtp, qwen3_5_mtp), "
            "num_speculative_tokens and disable_by_batch_size",
        ),
        (
            """--speculative-config '{"method": "mtp", "disable_by_batch_size": 0}'""",
            "--speculative-config: disable_by_batch_size 0: expected an integer >= 1",
        ),
        ("--speculative-config mtp", "--speculative-config: not JSON (Expecting value"),
        (
            """--speculative-config '{"method": "mtp", "num_speculative_tokens": 5}'""",
            """--speculative-config {"method": "mtp", "num_speculative_tokens": 5}: expected 0 """
            "(off), 1, 2 or 3 (as --mtp-step)",
        ),
        (
            "--speculative-algorithm NGRAM --speculative-num-steps 2",
            "--speculative-algorithm NGRAM: not supported: only the checkpoint's own MTP head "
            "drafts here (NEXTN, EAGLE, MTP without a draft model)",
        ),
        ("--speculative-algorithm NEXTN", "give --speculative-num-steps N"),
        (
            "--speculative-num-steps 3 --speculative-eagle-topk 1",
            "--speculative-num-steps, --speculative-eagle-topk without --speculative-algorithm",
        ),
        (
            "--speculative-algo NEXTN --speculative-num-steps 3 --speculative-eagle-topk 4",
            "--speculative-eagle-topk 4: not supported: MTP drafts one chain here, not a tree",
        ),
        (
            "--speculative-algo NEXTN --speculative-num-steps 3 --speculative-num-draft-tokens 8",
            "--speculative-num-draft-tokens 8: --speculative-num-steps 3 verifies 4 tokens a "
            "step (the drafts and one more); give 4 or leave it out",
        ),
        (
            "--reasoning-parser granite",
            "--reasoning-parser granite: not supported: the reasoning split here reads "
            "<think>...</think> (qwen3, qwen3_thinking, deepseek_r1)",
        ),
        (
            "--tool-call-parser llama3_json",
            "--tool-call-parser llama3_json: not supported: the tool-call parser here reads "
            "Qwen's <tool_call> blocks, XML or JSON (qwen3_coder, qwen3_xml, hermes, qwen25, qwen)",
        ),
        (
            """--limit-mm-per-prompt '{"image": 2, "video": 1}'""",
            "--limit-mm-per-prompt: video 1: not supported: this appliance takes images and "
            "text, no video; give video 0 or leave it out",
        ),
        ("--limit-mm-per-prompt.video 2", "--limit-mm-per-prompt: video 2: not supported"),
        (
            """--limit-mm-per-prompt '{"pointcloud": 1}'""",
            "--limit-mm-per-prompt: 'pointcloud': expected image, video or audio",
        ),
        (
            "--context-length 1",
            "--context-length 1: expected 0 (the checkpoint's) or an integer >= 2 "
            "(as --max-model-len)",
        ),
        ("--mm-encoder-tp-mode pipeline", "argument --mm-encoder-tp-mode: invalid choice"),
        (
            "--mamba-ssm-cache-dtype bfloat16",
            "--mamba-ssm-cache-dtype bfloat16: not supported: the Gated-DeltaNet state is kept "
            "in float32 (auto)",
        ),
        (
            "--data-parallel-size 2",
            "--data-parallel-size 2: not supported: data parallelism is not served here",
        ),
        ("--pp-size 2", "--pipeline-parallel-size 2: not supported: pipeline parallelism is not"),
        ("--ssl-keyfile k.pem", "--ssl-keyfile k.pem: not supported: TLS is not served here"),
        ("--speculative-draft-model-path x", "--speculative-draft-model-path: use --mtp-step"),
    ],
)
def test_refused_values_are_one_line(capsys, argv, expected):
    assert expected in _refused(["serve", "/m", *shlex.split(argv)], capsys)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            """--mtp-step 2 --speculative-config '{"method":"mtp","num_speculative_tokens":3}'""",
            """--speculative-config {"method":"mtp","num_speculative_tokens":3} and --mtp-step 2 """
            "disagree on mtp_step (3 vs 2); give one",
        ),
        (
            "--context-length 4096 --max-model-len 8192",
            "--context-length 4096 and --max-model-len 8192 disagree on max_model_len",
        ),
        (
            "--disable-radix-cache --enable-prefix-caching",
            "--enable-prefix-caching and --disable-radix-cache disagree on prefix_caching",
        ),
        (
            "--language-model-only --vision",
            "--language-model-only and --vision disagree on vision (False vs True)",
        ),
        (
            """--speculative-config '{"method":"mtp","num_speculative_tokens":2}' """
            "--speculative-algorithm NEXTN --speculative-num-steps 3",
            "--speculative-algorithm NEXTN --speculative-num-steps 3 disagree on mtp_step (2 vs 3)",
        ),
        ("--model-path /n", "--model-path /n and MODEL /m disagree on model_dir"),
    ],
)
def test_one_setting_given_two_ways_must_agree(capsys, argv, expected):
    assert expected in _refused(["serve", "/m", *shlex.split(argv)], capsys)


def test_one_setting_given_two_ways_alike_is_taken():
    argv = """--mtp-step 2 --speculative-config '{"method":"mtp","num_speculative_tokens":2}'"""
    config, _ = _serve(f"serve /m {argv} --context-length 4096 --max-model-len 4096")
    assert config.engine.scheduler.mtp_step == 2 and config.engine.model.max_model_len == 4096
    config, _ = _serve("serve --model /m --tp 2")
    assert config.engine.model.model_dir == "/m"


def test_serve_logs_the_ignored_flags_after_logging_starts(tiny_dense, monkeypatch, capsys):
    import appliance.launch

    served = []
    monkeypatch.setattr(appliance.launch, "serve", lambda config: served.append(config) or 0)
    port = str(free_port())
    argv = ["serve", str(tiny_dense), "--port", port, "--trust-remote-code", "--enable-metrics"]
    assert main([*argv, "--reasoning-parser", "qwen3"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ": ignored: " in line]
    assert len(lines) == 2 and all(" INFO " in line for line in lines), err
    assert "--trust-remote-code: ignored: no remote code runs" in lines[0]
    assert "--enable-metrics: ignored: /metrics (Prometheus) is always served" in lines[1]
    assert served[0].server.reasoning == "on"


def test_offline_keywords_read_the_same_table(monkeypatch):
    notes: list[str] = []
    monkeypatch.setattr(offline_options.logger, "info", notes.append)
    options = dict(
        speculative_config={"method": "qwen3_next_mtp", "num_speculative_tokens": 2},
        enable_chunked_prefill=True,
        disable_log_stats=True,
        swap_space=4,
        trust_remote_code=True,
        enable_prefix_caching=False,
        context_length=4096,
        limit_mm_per_prompt={"image": 2, "video": 0},
        tensor_parallel_size=2,
    )
    assert vllm_keywords(options, 1, "/m") == 2
    assert options == dict(mtp_step=2, prefix_caching=False, max_model_len=4096)
    assert sorted(notes) == [
        "disable_log_stats=True: ignored: the periodic stats line is set by "
        "APPLIANCE_LOG_STATS_INTERVAL (0 = off)",
        "enable_chunked_prefill=True: ignored: prefill is always chunked here "
        "(--max-num-batched-tokens tokens a step)",
        "limit_mm_per_prompt={'image': 2, 'video': 0}: ignored offline "
        "(max_images_per_request is a server setting)",
        "swap_space=4: ignored: no CPU swap: a preempted request is recomputed from its tokens "
        "when re-admitted",
        "trust_remote_code=True: ignored: no remote code runs: the model classes are built in",
    ]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (dict(speculative_config={"method": "ngram"}), "speculative_config: method 'ngram' not"),
        (
            dict(mtp_step=2, speculative_config={"method": "mtp", "num_speculative_tokens": 3}),
            "speculative_config={'method': 'mtp', 'num_speculative_tokens': 3} and mtp_step=2 "
            "disagree on mtp_step (3 vs 2); give one",
        ),
        (
            dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=2),
            "speculative_eagle_topk 2: not supported",
        ),
        (dict(limit_mm_per_prompt={"video": 1}), "limit_mm_per_prompt: video 1: not supported"),
        (dict(tool_call_parser="mistral"), "tool_call_parser='mistral': not supported"),
    ],
)
def test_offline_keywords_refused_like_the_flags(options, expected):
    with pytest.raises(ValueError) as info:
        vllm_keywords(dict(options), 1, "/m")
    assert expected in str(info.value)


def test_the_offline_llm_drafts_as_speculative_config_asks(tiny_dense):
    from appliance import LLM

    spec = {"method": "mtp", "num_speculative_tokens": 2}
    opts = dict(max_num_seqs=2, num_kv_slots=512, max_model_len=128)
    with LLM(str(tiny_dense), speculative_config=spec, disable_radix_cache=True, **opts) as llm:
        assert llm.config.scheduler.mtp_step == 2 and not llm.config.scheduler.prefix_caching
