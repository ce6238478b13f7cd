"""Model resolution (appliance/assets/resolve.py, hub.py): Hub ids through a Hub cache this test
lays out itself (offline), revisions, a local folder winning over a Hub id, dummy weights needing
no weights, one-line errors that name the model and what was tried, and `LLM("ORG/NAME")`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from appliance.assets.resolve import ModelNotFoundError, resolve_model_dir
from tests.appliance.hub_cache import add_snapshot, commit_hash

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache, offline (huggingface_hub reads its env at import; patch constants)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # relative ORG/NAME folders are looked up here
    return cache


def test_hub_id_resolves_to_its_cached_snapshot(hub, tiny_dense) -> None:
    snapshot = add_snapshot(hub, "tiny-org/tiny-dense", tiny_dense)
    path = resolve_model_dir("tiny-org/tiny-dense")
    assert path == snapshot and path.name == commit_hash(f"tiny-org/tiny-dense:{tiny_dense}")
    weights = (path / "model.safetensors").read_bytes()
    assert weights == (tiny_dense / "model.safetensors").read_bytes()


def test_revision_picks_the_branch_or_commit(hub, tiny_dense, tiny_moe) -> None:
    main = add_snapshot(hub, "org/m", tiny_dense, refs=["main"], label="one")
    v2 = add_snapshot(hub, "org/m", tiny_moe, refs=["v2"], label="two")
    assert resolve_model_dir("org/m") == main
    assert resolve_model_dir("org/m", revision="v2") == v2
    assert resolve_model_dir("org/m", revision=commit_hash("one")) == main
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir("org/m", revision="v3")
    assert "'org/m' (revision v3)" in str(info.value)


def test_a_local_folder_wins_over_the_hub_id(hub, tiny_dense, tiny_moe, tmp_path) -> None:
    add_snapshot(hub, "org/same", tiny_moe)
    local = tmp_path / "org" / "same"
    local.parent.mkdir()
    os.symlink(tiny_dense, local)
    assert resolve_model_dir("org/same") == Path("org/same")
    assert resolve_model_dir("org/same").resolve() == tiny_dense.resolve()


def test_dummy_weights_need_only_config_and_tokenizer(hub, tiny_dense) -> None:
    snapshot = add_snapshot(hub, "org/no-weights", tiny_dense, skip=["model.safetensors"])
    assert resolve_model_dir("org/no-weights", load_format="dummy") == snapshot
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir("org/no-weights")
    message = str(info.value)
    assert f"the snapshot {snapshot} has no *.safetensors weights" in message
    assert "offline" in message and "\n" not in message


def test_missing_model_offline_names_everything_tried(hub, tmp_path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir("nobody/nothing")
    assert str(info.value) == (
        f"model 'nobody/nothing' (revision main): no folder {tmp_path / 'nobody/nothing'}; "
        f"not in the Hub cache {hub}, and HF_HUB_OFFLINE=1 forbids downloading it"
    )


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("/no/such/folder", "model '/no/such/folder': no such folder (/no/such/folder), and not a"),
        ("./org/name", "no such folder"),
        ("a/b/c", "not a Hub id (ORG/NAME)"),
    ],
)
def test_paths_that_are_not_hub_ids(hub, model, expected) -> None:
    with pytest.raises(ModelNotFoundError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        resolve_model_dir(model)


def test_local_folder_without_config_or_weights(hub, tmp_path, tiny_dense) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="not a checkpoint folder \\(no config.json\\)"):
        resolve_model_dir(str(empty))
    (empty / "config.json").write_text((tiny_dense / "config.json").read_text())
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors weights"):
        resolve_model_dir(str(empty))
    # no tokenizer: refused (transformers would build an empty one that encodes text as nothing)
    with pytest.raises(ModelNotFoundError, match=f"no tokenizer in {empty} \\(expected"):
        resolve_model_dir(str(empty), load_format="dummy")
    (empty / "vocab.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="tokenizer.json or vocab.json \\+ merges.txt"):
        resolve_model_dir(str(empty), load_format="dummy")
    (empty / "tokenizer.json").write_text((tiny_dense / "tokenizer.json").read_text())
    assert resolve_model_dir(str(empty), load_format="dummy") == empty


def test_revision_without_a_hub_id_is_refused(hub) -> None:
    with pytest.raises(ModelNotFoundError, match="only a Hub model id has revisions"):
        resolve_model_dir("", revision="v1")


def _resolve_in_subprocess(env: dict[str, str], model: str) -> subprocess.CompletedProcess:
    script = (
        "import sys\n"
        "from appliance.assets.resolve import ModelNotFoundError, resolve_model_dir\n"
        "try:\n"
        f"    print(resolve_model_dir({model!r}))\n"
        "except ModelNotFoundError as exc:\n"
        "    print(exc, file=sys.stderr); sys.exit(3)\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_hf_home_and_an_unreachable_hub(tmp_path, tiny_dense) -> None:
    """The real environment variables: HF_HOME's hub/ is the cache; online with the Hub out of
    reach (HF_ENDPOINT on a closed port), a cached model still resolves, a missing one says the
    Hub could not be reached."""
    home = tmp_path / "hf-home"
    snapshot = add_snapshot(home / "hub", "org/cached", tiny_dense)
    env = {"HF_HOME": str(home), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2"}
    found = _resolve_in_subprocess(env, "org/cached")
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(snapshot)
    missing = _resolve_in_subprocess(env, "org/absent")
    assert missing.returncode == 3, missing.stderr
    assert missing.stderr.strip().endswith(
        f"not in the Hub cache {home / 'hub'}, and the Hub could not be reached"
    )
    offline = _resolve_in_subprocess({**env, "HF_HUB_OFFLINE": "1"}, "org/absent")
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in offline.stderr


def test_llm_loads_a_hub_id(hub, tiny_dense) -> None:
    from appliance import LLM, SamplingParams

    add_snapshot(hub, "org/tiny", tiny_dense)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    opts = dict(max_num_seqs=2, num_kv_slots=512, max_model_len=128)
    from_hub = LLM("org/tiny", **opts)
    assert from_hub.model_dir.parent == hub / "models--org--tiny" / "snapshots"
    local = LLM(str(tiny_dense), **opts)
    assert from_hub.generate("def f(x):", params)[0].token_ids == (
        local.generate("def f(x):", params)[0].token_ids
    )
    with pytest.raises(ModelNotFoundError, match="'org/other' \\(revision main\\)"):
        LLM("org/other", **opts)
