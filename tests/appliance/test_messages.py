"""Every message type survives msgpack encode -> decode unchanged, both alone and through the socket
union it travels in; and no message type is left without a sample here."""

from __future__ import annotations

import msgspec
import pytest

from appliance import messages as m

OPTS = m.SamplingOptions(
    temperature=0.7,
    top_p=0.9,
    top_k=20,
    min_p=0.05,
    seed=7,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.1,
    logprobs=3,
    prompt_logprobs=2,
    guide=m.Guide("json_schema", '{"type": "object"}', after_token=11),
    thinking_budget=64,
    think_start=1998,
    think_end=1999,
)
DETOK = m.DetokParams(
    stop=["\n\n", "END"], include_stop_str_in_output=True, skip_special_tokens=False, logprobs=True
)
SCHED = m.SchedulerStats(
    num_running=2,
    num_waiting=1,
    kv_used=64,
    kv_total=256,
    state_used=2,
    state_total=4,
    num_preemptions=1,
    num_prompt_tokens=40,
    num_generation_tokens=12,
    num_computed_tokens=52,
    num_finished=3,
    num_steps=9,
    mtp_drafts=3,
    mtp_draft_tokens=6,
    mtp_accepted_tokens=5,
    mtp_accepted_per_position=[3, 2],
    prefix_cache_queries=40,
    prefix_cache_hits=30,
    prefix_cache_nodes=3,
    prefix_cache_tokens=50,
    snapshots_used=2,
    snapshots_total=8,
)
STATS = m.RouterStats(
    scheduler=SCHED, queue_time_s=[0.01, 0.2], step_overhead_ms=0.3, step_forward_ms=4.5
)
PROGRESS = m.RequestProgress("r1", "running", 12, 3, 14, 15, 0)
STATUS = m.RouterStatus(query_id=5, stats=STATS, requests=[PROGRESS])
PROMPT_LP = m.PromptLogprobs(0, [3, 8], [None, -1.5], [[], [(8, -1.5), (2, -2.0)]], [0, 1])
UPDATE = m.TokenUpdate(
    "r1",
    [4, 5],
    "length",
    [-0.1, -0.2],
    [[(4, -0.1), (9, -2.0)], [(5, -0.2)]],
    None,
    0,
    PROMPT_LP,
    cached_tokens=2,
    spec=m.SpecCounts([[1, 0], [0, 1, 1]]),
    timing=m.RequestTiming(0.01, 0.2, 1.5),
)
LOGPROB = m.TokenLogprob(
    "hé",
    -0.25,
    [104, 195, 169],
    [("hé", -0.25, [104, 195, 169]), ("x", -3.0, [120])],
    token_id=17,
    top_ids=[17, 5],
    rank=1,
)
FIRST = m.TokenLogprob("a", None, [97])
SPEC = m.SpecCounts(by_length=[[1, 0], [0, 1, 1]])
TIMING = m.RequestTiming(queue_s=0.01, ttft_s=0.2, generation_s=1.5)
DELTA = m.TextDelta(
    "r1", "hé", [4, 5], 7, "stop", [LOGPROB, LOGPROB], None, 0, [FIRST, LOGPROB], 2, SPEC, TIMING
)
WORKER = m.WorkerInfo(
    num_kv_slots=1024,
    max_model_len=512,
    eos_token_ids=[2, 7],
    num_snapshot_slots=8,
    linear_state=True,
)

IMAGE = m.ImageInput(
    offset=1, num_tokens=4, grid_thw=(1, 4, 4), handle="shm-ab12", content_key="sha256:ab12"
)
NEW = m.NewRequest(
    3,
    [1, 2, 3, 4, 5, 6],
    OPTS,
    num_prompt_tokens=5,
    num_draft=2,
    mm=[IMAGE],
    cached_kv_slots=[7, 8],
    restore_snapshot=4,
)
CHUNK = m.ScheduledChunk(3, 5, 3, [10, 11, 12], True, num_draft=2, save_snapshot=6)
SAVE = m.SnapshotSave(req_slot=3, snapshot=6)
IMAGE_DATA = m.ImageData("ab12cd_1x4x4", b"\x89PNG\r\n", 3, (1, 4, 4), 1024, 4096)
VISUAL_STATS = m.VisualStats(3, 1, 4096, 5, 2, [0.01], [0.02, 0.03])
VISUAL_INFO = m.VisualInfo("cuda:0", 2**30, 900_000_000, (1, 64, 64), 8)

PROFILE = m.ProfileAction(True, "/t", "p", ["CPU", "MEM"], True, False, 3)

SAMPLES: dict[type, msgspec.Struct] = {
    m.SamplingOptions: OPTS,
    m.Guide: OPTS.guide,
    m.ImageInput: IMAGE,
    m.NewRequest: NEW,
    m.ScheduledChunk: CHUNK,
    m.SnapshotSave: SAVE,
    m.ProfileAction: PROFILE,
    m.StepPlan: m.StepPlan(1, [NEW], [CHUNK], [1, 2], [SAVE], PROFILE),
    m.ProfileReport: m.ProfileReport(True, "2 steps profiled", False, ["/t/p-TP-0.trace.json.gz"]),
    m.ProfileRequest: m.ProfileRequest(7, PROFILE),
    m.ProfileAnswer: m.ProfileAnswer(7, False, "the profiler is not running"),
    m.SampledTokens: m.SampledTokens(3, [42], [-0.5], [[(42, -0.5), (7, -1.5)]]),
    m.PromptLogprobs: PROMPT_LP,
    m.PromptScores: m.PromptScores(3, m.PromptLogprobs(4, [8], [-1.5], [[(8, -1.5)]])),
    m.StepResult: m.StepResult(
        1,
        [m.SampledTokens(3, [42], [-0.5], [[(42, -0.5)]])],
        0.01,
        [m.PromptScores(3, m.PromptLogprobs(1, [8, 9], [-1.5, -0.5], [[], []]))],
        [4],
        m.ProfileReport(True, "profiling CPU, CUDA", True),
    ),
    m.DetokParams: DETOK,
    m.TokenizedRequest: m.TokenizedRequest(
        "cmpl-1-0",
        [1, 2],
        OPTS,
        16,
        True,
        [9],
        DETOK,
        1.5,
        [IMAGE_DATA],
        [IMAGE],
        1,
        3,
        True,
        m.RepetitionCheck(1, 4, 3),
        "t",
    ),
    m.RepetitionCheck: m.RepetitionCheck(2, 5, 2),
    m.AbortRequest: m.AbortRequest("cmpl-1-0"),
    m.ImageData: IMAGE_DATA,
    m.RejectRequest: m.RejectRequest("cmpl-1-0", "bad image", 400),
    m.VisualStats: VISUAL_STATS,
    m.ReleaseImages: m.ReleaseImages(["cmpl-1-0", "cmpl-1-1"]),
    m.VisualInfo: VISUAL_INFO,
    m.FinishRequest: m.FinishRequest("cmpl-1-0", "stop"),
    m.StatusQuery: m.StatusQuery(5),
    m.ResetPrefixCache: m.ResetPrefixCache(6),
    m.PrefixCacheReset: m.PrefixCacheReset(6, True, 120, 4, 30, 1),
    m.DetokRegister: m.DetokRegister("r1", 12, DETOK),
    m.TokenUpdate: UPDATE,
    m.SchedulerStats: SCHED,
    m.RouterStats: STATS,
    m.RequestProgress: PROGRESS,
    m.RouterStatus: STATUS,
    m.RouterOutput: m.RouterOutput([m.DetokRegister("r1", 12, DETOK)], [UPDATE]),
    m.TokenLogprob: LOGPROB,
    m.TextDelta: DELTA,
    m.SpecCounts: SPEC,
    m.RequestTiming: TIMING,
    m.DetokOutput: m.DetokOutput([DELTA], num_live=3),
    m.WorkerInfo: WORKER,
    m.StartupProgress: m.StartupProgress("worker", 1, "loading model"),
    m.ProcessReady: m.ProcessReady("worker", 0, 1234, WORKER, VISUAL_INFO),
    m.Drained: m.Drained(aborted=2),
    m.Heartbeat: m.Heartbeat("worker", 1),
    m.StartupFailed: m.StartupFailed(
        "worker 1", "CheckpointMismatch: missing keys: lm_head.weight"
    ),
    m.EngineReady: m.EngineReady(max_model_len=512, num_kv_slots=1024),
    m.Drain: m.Drain(timeout_s=30.0),
    m.Fatal: m.Fatal("worker 1", "worker 1 (pid 99) died with exit code -9"),
}

UNIONS = {
    m.ToRouter: (
        m.TokenizedRequest,
        m.AbortRequest,
        m.FinishRequest,
        m.StatusQuery,
        m.ResetPrefixCache,
        m.RejectRequest,
        m.ProfileRequest,
    ),
    m.ToVisual: (
        m.TokenizedRequest,
        m.AbortRequest,
        m.StatusQuery,
        m.ResetPrefixCache,
        m.ReleaseImages,
        m.ProfileRequest,
    ),
    m.ToServer: (
        m.DetokOutput,
        m.RouterStats,
        m.RouterStatus,
        m.PrefixCacheReset,
        m.VisualStats,
        m.ProfileAnswer,
    ),
    m.ToLauncher: (m.StartupProgress, m.ProcessReady, m.Drained, m.Heartbeat, m.StartupFailed),
    m.ToServerControl: (m.EngineReady, m.Drain, m.Fatal),
}


def test_every_message_type_has_a_sample():
    defined = {
        obj
        for obj in vars(m).values()
        if isinstance(obj, type)
        and issubclass(obj, msgspec.Struct)
        and obj.__module__ == m.__name__
    }
    assert defined == set(SAMPLES)


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
def test_round_trip(cls):
    msg = SAMPLES[cls]
    wire = m.encode(msg)
    assert isinstance(wire, bytes)
    back = m.decoder(cls).decode(wire)
    assert back == msg and type(back) is cls


@pytest.mark.parametrize("union", list(UNIONS), ids=str)
def test_union_round_trip(union):
    dec = m.decoder(union)
    for cls in UNIONS[union]:
        back = dec.decode(m.encode(SAMPLES[cls]))
        assert type(back) is cls and back == SAMPLES[cls]


def test_wrong_type_is_rejected():
    with pytest.raises(msgspec.ValidationError):
        m.decoder(m.ToRouter).decode(m.encode(m.Drain(1.0)))
    with pytest.raises(msgspec.ValidationError):
        m.decoder(m.StepPlan).decode(m.encode(m.StatusQuery(1)))
