"""generate(): a long prompt goes through memory segment by segment, then decoding continues with it."""

import pytest
import torch
from model_helpers import VOCAB, run_stream

S = 10  # segment length


def _prompt(batch=2, length=34, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _greedy_reference(model, prompt, new_tokens):
    """Memory steps over the complete segments, then greedy decoding by full recomputation."""
    n_full = (prompt.shape[1] - 1) // S
    with torch.no_grad():
        _, memory = run_stream(model, list(prompt[:, : n_full * S].split(S, dim=1)))
        context = model.memory_context(memory, prompt.shape[0])
        seq = prompt[:, n_full * S :]
        for _ in range(new_tokens):
            logits = model(seq, memory_context=context).logits[:, -1]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return torch.cat([prompt[:, : n_full * S], seq], dim=1)


@pytest.mark.parametrize("preset", ["memoria", "xl", "transformer", "xl+memoria", "xl+memoria_gated"])
def test_greedy_generate_matches_a_reference_decode(make_model, preset):
    model = make_model(preset, memory_init="random")
    prompt = _prompt()
    out = model.generate(prompt, segment_length=S, max_new_tokens=6, do_sample=False)
    assert out.shape == (2, 40) and torch.equal(out[:, :34], prompt)
    assert torch.equal(out, _greedy_reference(model, prompt, 6))


def test_generation_uses_the_memory(make_model):
    model = make_model("memoria", memory_init="random")
    a, b = _prompt(seed=1), _prompt(seed=1)
    b[:, :10] = (b[:, :10] + 1) % VOCAB  # change only the first segment
    kwargs = dict(segment_length=S, max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
    sa, sb = model.generate(a, **kwargs), model.generate(b, **kwargs)
    assert torch.equal(sa.sequences[:, :34], a)
    assert (sa.scores[0] - sb.scores[0]).abs().max() > 1e-6


def test_generate_advances_the_given_memory(make_model):
    model = make_model("memoria", memory_init="random")
    memory = model.empty_memory(2)
    model.generate(_prompt(), memory=memory, segment_length=S, max_new_tokens=2, do_sample=False)
    assert memory.state.step.tolist() == [2, 2]  # 3 complete segments fed: 2 memory steps after the first


def test_beams_and_several_sequences(make_model):
    model = make_model("memoria", memory_init="random")
    out = model.generate(_prompt(), segment_length=S, max_new_tokens=3, num_beams=2, num_return_sequences=2)
    assert out.shape == (4, 37) and torch.equal(out[:, :34], _prompt()[[0, 0, 1, 1]])
    sampled = model.generate(_prompt(), segment_length=S, max_new_tokens=3, do_sample=True, num_return_sequences=3)
    assert sampled.shape == (6, 37) and torch.equal(sampled[:3, :34], _prompt()[[0, 0, 0]])


def test_a_prompt_longer_than_positions_needs_a_segment_length(make_model):
    model = make_model("memoria")
    with pytest.raises(ValueError, match="segment_length"):
        model.generate(_prompt(length=300), max_new_tokens=1)
