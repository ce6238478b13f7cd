"""M-RoPE positions and rope deltas (appliance/models/mrope.py) against transformers'
`get_rope_index` of Qwen3-VL and Qwen3.5, for single sequences and a left-padded batch."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from appliance.models.mrope import ImageSpan, MRopeLayout, image_spans, mrope_positions

IMAGE, START, END = 7, 5, 6  # <|image_pad|>, <|vision_start|>, <|vision_end|> in these tests
MERGE = 2

# Prompt layouts: an int is that many text tokens, a (h, w) pair an image with that patch grid
# (t = 1), wrapped in vision start/end tokens unless "bare".
CASES = {
    "one_square": [5, (4, 4), 9],
    "image_first": [(4, 8), 3],
    "two_images": [3, (6, 4), 4, (4, 4), 2],
    "back_to_back": [2, (4, 4), (8, 2), 1],
    "large_and_strip": [1, (32, 20), 3, (2, 40), 4],
    "text_only": [12],
    "ends_with_image": [4, (6, 6), "bare"],
}


def build(layout: list) -> tuple[list[int], list[ImageSpan]]:
    bare = "bare" in layout
    ids, spans = [], []
    for piece in layout:
        if piece == "bare":
            continue
        if isinstance(piece, int):
            ids += [100 + (len(ids) + i) % 50 for i in range(piece)]
            continue
        h, w = piece
        if not bare:
            ids.append(START)
        spans.append(ImageSpan(len(ids), (1, h, w)))
        ids += [IMAGE] * (h * w // MERGE**2)
        if not bare:
            ids.append(END)
    return ids, spans


@functools.lru_cache(maxsize=2)
def hf_model(family: str) -> torch.nn.Module:
    tokens = dict(
        image_token_id=IMAGE, video_token_id=8, vision_start_token_id=START, vision_end_token_id=END
    )
    text = dict(
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=256,
        rope_parameters=dict(
            rope_type="default", rope_theta=1e4, mrope_section=[4, 2, 2], mrope_interleaved=True
        ),
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        num_heads=1,
        intermediate_size=16,
        out_hidden_size=32,
        num_position_embeddings=16,
        spatial_merge_size=MERGE,
    )
    if family == "qwen3_vl":
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
        return transformers.Qwen3VLModel(config).eval()
    text.update(
        layer_types=["full_attention"],
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, **tokens)
    return transformers.Qwen3_5Model(config).eval()


def hf_rope_index(
    family: str, seqs: list[list[int]], grids: list[tuple[int, int, int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded batch -> (positions [3, B, L], deltas [B], attention mask [B, L])."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    kwargs = dict(mm_token_type_ids=(ids == IMAGE).int(), attention_mask=mask)
    if grids:
        kwargs["image_grid_thw"] = torch.tensor(grids)
    positions, deltas = hf_model(family).get_rope_index(ids, **kwargs)
    return positions, deltas.reshape(-1), mask


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("case", list(CASES))
def test_positions_and_delta_match_hf(family, case):
    ids, spans = build(CASES[case])
    ref, ref_delta, _ = hf_rope_index(family, [ids], [s.grid_thw for s in spans])
    positions, delta = mrope_positions(len(ids), spans, MERGE)
    assert positions.dtype == torch.int64 and positions.shape == (3, len(ids))
    assert torch.equal(positions, ref[:, 0])
    assert delta == int(ref_delta[0])


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_left_padded_batch_matches_hf(family):
    built = [build(CASES[c]) for c in ("two_images", "text_only", "one_square", "image_first")]
    seqs = [ids for ids, _ in built]
    grids = [s.grid_thw for _, spans in built for s in spans]
    ref, ref_deltas, mask = hf_rope_index(family, seqs, grids)
    for b, (ids, spans) in enumerate(built):
        positions, delta = mrope_positions(len(ids), spans, MERGE)
        assert torch.equal(positions, ref[:, b, mask[b].bool()])
        assert delta == int(ref_deltas[b])


def test_models_md_worked_example():
    # models.md §4.3/§4.4: 18 tokens, a 4-token image (grid 1x4x4) at indices 4..7
    ids = [1, 2, 3, START] + [IMAGE] * 4 + [END] + list(range(20, 29))
    positions, delta = mrope_positions(len(ids), image_spans(ids, IMAGE, [(1, 4, 4)], 2), 2)
    assert positions[0, :11].tolist() == [0, 1, 2, 3, 4, 4, 4, 4, 6, 7, 8]
    assert positions[1, :10].tolist() == [0, 1, 2, 3, 4, 4, 5, 5, 6, 7]
    assert positions[2, :10].tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7]
    assert delta == -2


@pytest.mark.parametrize("case", ["two_images", "large_and_strip", "ends_with_image"])
def test_any_range_equals_the_slice_and_decode_adds_delta(case):
    ids, spans = build(CASES[case])
    layout = MRopeLayout(spans, MERGE)
    full = layout.positions(0, len(ids))
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        a, b = sorted(torch.randint(0, len(ids) + 1, (2,), generator=gen).tolist())
        assert torch.equal(layout.positions(a, b), full[:, a:b])
    # positions past the prompt (decode, MTP verify rows): index + delta on all three rows
    after = layout.positions(len(ids), len(ids) + 6)
    expected = torch.arange(len(ids), len(ids) + 6) + layout.rope_delta
    assert torch.equal(after, expected.expand(3, -1))
    # and the first decode position continues right after the prompt's largest position
    assert int(after[0, 0]) == int(full.max()) + 1


def test_invalid_layouts_raise():
    with pytest.raises(ValueError, match="t=2"):
        MRopeLayout([ImageSpan(0, (2, 4, 4))], MERGE)
    with pytest.raises(ValueError, match="multiple of merge size"):
        MRopeLayout([ImageSpan(0, (1, 4, 5))], MERGE)
    with pytest.raises(ValueError, match="overlaps"):
        MRopeLayout([ImageSpan(0, (1, 4, 4)), ImageSpan(3, (1, 4, 4))], MERGE)
    with pytest.raises(ValueError, match="past 6 tokens"):
        mrope_positions(6, [ImageSpan(4, (1, 4, 4))], MERGE)


def test_image_spans_pairs_runs_with_grids():
    ids, spans = build(CASES["back_to_back"])
    assert image_spans(ids, IMAGE, [s.grid_thw for s in spans], MERGE) == spans
    with pytest.raises(ValueError, match="expected 4 image tokens"):
        image_spans([1, IMAGE, IMAGE, 2], IMAGE, [(1, 4, 4)], MERGE)
    with pytest.raises(ValueError, match="2 image grids given but 1"):
        image_spans([1] + [IMAGE] * 4, IMAGE, [(1, 4, 4), (1, 4, 4)], MERGE)
    with pytest.raises(ValueError, match="more image token runs"):
        image_spans([IMAGE] * 4 + [1] + [IMAGE] * 4, IMAGE, [(1, 4, 4)], MERGE)
