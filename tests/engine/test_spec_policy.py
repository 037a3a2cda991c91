"""Speculation that pays (``zoo.engine.spec_policy``): per-step draft lengths and sources.

- Prompt lookup proposes what followed the latest earlier occurrence of the context's last n-gram.
- The acceptance rule with per-row draft lengths and certain (lookup) proposals keeps the target
  distribution; past a row's proposed drafts the bonus comes from the target alone.
- Output under ``auto`` (every option tried: drafting off, 1..K MTP drafts, prompt-lookup drafts)
  is plain decoding's, greedy and seeded sampled rows alike, for both tiny models and for a
  json_schema-constrained row.
- ``auto`` picks the option with the most tokens per second from the costs it timed.

The engine runs are on the demo models' configs with one decoder layer of each kind and random weights
(``random_tiny_checkpoint``), as bigram variants (``bigram_variant``: their MTP heads' drafts are mostly
accepted, and their greedy answers repeat spans that prompt lookup finds): the policy and the outputs
are the engine's, whatever the weights, and a shallower model is less to compile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.helpers import bigram_variant, random_tiny_model
from zoo.engine.constraint import OutputGrammar
from zoo.engine.generator import Generator
from zoo.engine.spec_policy import MIN_SAMPLES, Acceptance, PromptLookup, SpecPolicy, parse_key, reach, table_key
from zoo.engine.speculative import accept
from zoo.server import grammar as G

K = 3


def tv(samples: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * np.abs(np.bincount(samples, minlength=len(p)) / len(samples) - p).sum()


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence():
    idx = PromptLookup()
    idx.extend([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 0])
    assert idx.propose(3) == ([], 0)                          # "8 0": never seen before
    idx.extend([1, 2, 3])
    assert idx.propose(3) == ([7, 8, 0], 3)                   # "0 1 2 3" is new; the latest "1 2 3": 7 8 0
    assert idx.propose(1) == ([7], 3)
    idx.extend([6, 4, 5])
    assert idx.propose(2) == ([9, 1], 2)                      # no 3- or 4-gram: the bigram "4 5"
    one = PromptLookup()
    one.extend([5, 5])
    assert one.propose(2) == ([], 0)                          # the context's own last n-gram is not a match
    one.extend([5])
    assert one.propose(2) == ([5], 2)


def test_expected_tokens_and_shrunk_acceptance():
    assert reach(Acceptance(3), [0.5] * 3, 0) == [1.0]                 # no counts: the pool's rates
    assert reach(Acceptance(3), [0.5] * 3, 2) == pytest.approx([1, 1.5, 1.75])
    a = Acceptance(3)
    a.add(3, 1, capped=False)                                 # position 1 accepted, 2 rejected, 3 unreached
    a.add(3, 3, capped=False)
    assert a.tried == [2, 2, 1] and a.accepted == [2, 1, 1]
    a.add(3, 1, capped=True)                                  # capped after 1: no rejection seen
    assert a.tried == [3, 2, 1]
    assert reach(a, [0.5] * 3, 1)[1] == pytest.approx(1 + (3 + 3 * 0.5) / (3 + 3))     # 3 pseudo-tries of the pool


def test_lengths_and_certain_drafts_keep_the_target_distribution():
    """V = 6, k = 3: rows proposing 1 draft drawn from q (a MTP-like proposal) and rows proposing 3
    certain drafts (lookup); 200k rows each. The first token is distributed as p_0 either way, a
    length-1 row's bonus as p_1, a lookup row's second token as p_1; a certain draft passes with
    probability p(d)."""
    rng = np.random.default_rng(0)
    v, k, n = 6, 3, 200_000
    p = rng.dirichlet(np.ones(v), size=k + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(v) * 0.5, size=k).astype(np.float32)
    keys = jax.random.split(jax.random.key(2), n * (k + 1)).reshape(n, k + 1)
    run = jax.jit(accept)
    drafts = jax.vmap(lambda kk: jax.random.categorical(kk, jnp.log(q[0])))(keys[:, 0])   # coupled, as MTP's
    d = jnp.zeros((n, k), jnp.int32).at[:, 0].set(drafts)
    n_acc, extra = map(np.asarray, run(keys, jnp.broadcast_to(p, (n, k + 1, v)), d, jnp.zeros(n, bool),
                                        jnp.ones(n, jnp.int32)))
    assert n_acc.max() == 1
    first = np.where(n_acc >= 1, np.asarray(drafts), extra)
    assert tv(first, p[0]) < 0.01
    assert tv(extra[n_acc == 1], p[1]) < 0.01                     # the bonus: p_1 itself
    certain = np.argmax(p[:k], axis=-1).astype(np.int32)           # likely drafts: many rows get far
    d = jnp.broadcast_to(certain, (n, k))
    n_acc, extra = map(np.asarray, run(keys, jnp.broadcast_to(p, (n, k + 1, v)), d, jnp.zeros(n, bool),
                                       jnp.full(n, k, jnp.int32)))
    assert abs(np.mean(n_acc >= 1) - p[0][certain[0]]) < 0.01   # a certain draft passes with p(d)
    first = np.where(n_acc >= 1, certain[0], extra)
    assert tv(first, p[0]) < 0.01
    second = np.where(n_acc >= 2, certain[1], extra)[n_acc >= 1]
    assert second.size > 20_000 and tv(second, p[1]) < 0.015


class PolicyRow:
    """What ``SpecPolicy`` reads of a request: a prompt of 3 tokens, 1 emitted."""

    def __init__(self):
        self.prompt, self.raw, self.stats, self.spec = [1, 2, 3], [4], {}, None


def test_auto_picks_the_most_tokens_per_second():
    """Costs timed: drafting off 1.0 s; 1 draft 1.1 s; 2 drafts 3 s; 3 drafts 3.2 s. Rows accepting
    0.9 of drafts gain from one draft (1.9 tokens in 1.1 s) but not from more; rows accepting none
    draft nothing."""
    policy = SpecPolicy(3, "auto", lookup=False)

    rows, active = [PolicyRow(), PolicyRow()], np.ones(2, bool)
    cap, force = np.full(2, 4, np.int32), np.full(2, -1, np.int32)
    seconds = {"off": 1.0, "d1": 1.1, "d2": 3.0, "d3": 3.2}
    for _ in range(MIN_SAMPLES * 4):                        # every option is timed first, in order
        plan = policy.plan(rows, active, cap, force)
        policy.observe(plan, rows, np.ones(2, np.int32), cap, seconds[plan.option])
    assert all(policy.chosen[o] == MIN_SAMPLES for o in seconds)
    for row in rows:                                         # acceptance 0.9 at every position, well known
        row.spec.mtp.tried = [100.0] * 3
        row.spec.mtp.accepted = [90.0] * 3
    assert policy.plan(rows, active, cap, force).option == "d1"
    for row in rows:
        row.spec.mtp.accepted = [0.0] * 3
    assert policy.plan(rows, active, cap, force).option == "off"
    for row in rows:                                         # 0.9 again, one draft at 1.85 s: 2.05 tokens/s
        row.spec.mtp.accepted = [90.0] * 3                       # against 2.0 drafting off, within the margin
    policy.table["d1@2"][0] = 1.85
    policy.table["d2@2"][0] = policy.table["d3@2"][0] = 5.0
    assert policy.plan(rows, active, cap, force).option == "off"
    table = policy.export()
    follower = SpecPolicy(3, "auto", lookup=False, lockstep=True)
    plan = follower.plan(rows, active, cap, force)             # in lockstep, no table loaded: as fixed
    assert plan.option == "d3" and plan.lengths.tolist() == [3, 3]
    follower.load(table)
    assert follower.table == {key: list(v) for key, v in table.items()} and follower.shared
    assert follower.plan(rows, active, cap, force).option == "d1"    # the exported medians: 1 draft at 1.1 s


def test_the_narrow_programs_steps_are_timed_apart():
    """A step of the narrow decode programs (``Plan.width``) is timed under its own keys
    (``"option@rows/width"``) and decided from them: on a CPU it costs what its rows cost, not what
    the whole batch's step costs at the same count of decoding rows. Here drafting pays on the narrow
    program (1 draft 1.1 s against 1.0 s off) and not on the whole batch's (3.0 s against 1.0 s)."""
    policy = SpecPolicy(3, "auto", lookup=False)

    rows, active = [PolicyRow(), PolicyRow(), None, None], np.array([True, True, False, False])
    cap, force = np.full(4, 4, np.int32), np.full(4, -1, np.int32)
    seconds = {0: {"off": 1.0, "d1": 3.0, "d2": 3.5, "d3": 4.0}, 2: {"off": 1.0, "d1": 1.1, "d2": 3.0, "d3": 3.2}}
    for width in (0, 2):                                     # each width's options are timed first, in order
        for _ in range(MIN_SAMPLES * 4):
            plan = policy.plan(rows, active, cap, force, width)
            assert plan.width == width
            policy.observe(plan, rows, np.array([1, 1, 0, 0], np.int32), cap, seconds[width][plan.option])
    assert set(policy.table) == {table_key(o, 2, w) for o in seconds[0] for w in (0, 2)}
    assert parse_key("d1@2/2") == ("d1", 2, 2) and parse_key("off@16") == ("off", 16, 0)
    for row in rows[:2]:                                     # acceptance 0.9 at every position
        row.spec.mtp.tried, row.spec.mtp.accepted = [100.0] * 3, [90.0] * 3
    assert policy.plan(rows, active, cap, force, 2).option == "d1"
    assert policy.plan(rows, active, cap, force, 0).option == "off"
    assert policy._costs(2, 4) == dict.fromkeys(policy.options)       # a width never timed: nothing to go by


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {name: bigram_variant(random_tiny_model(tmp_path_factory, name)) for name in ("qwen38-tiny", "glm53-tiny")}


def second_turn(model, question: str = "What is 12+35?") -> list[int]:
    """A chat whose second turn asks the first turn's question again, after the model's own answer:
    its new answer repeats spans of the first (what prompt lookup finds)."""
    tok = model.tokenizer
    first = [{"role": "user", "content": question}]
    answer = Generator(model, max_batch=4, prefix_cache=0).generate(      # the plain generator's shape below
        [tok.encode(tok.apply_chat_template(first))], max_new_tokens=60)[0]
    chat = first + [{"role": "assistant", "content": tok.decode(answer.tokens)}, {"role": "user", "content": question}]
    return tok.encode(tok.apply_chat_template(chat))


def costs(off: float, drafts: float) -> dict:
    """A cost table (``SpecPolicy.export``'s form) for every batch size: decisions that do not hang
    on this machine's timings. The periodic re-timing takes the cheaper kind (drafting when equal)."""
    refreshed = "off" if off < drafts else "d1"
    return {f"{o}@{b}": [off if o == "off" else drafts, 9, 0 if o == refreshed else 10**9]
            for o in ("off", "d1", "d2", "d3") for b in (1, 2, 4)}


SAMPLED = [dict(temperature=0.8, top_p=0.95, seed=3), dict(temperature=1.0, top_k=40, seed=11)]


def generate_mixed(gen: Generator, prompts: list, n_new: int = 60) -> list:
    """Each prompt greedy, then the first two again sampled (``SAMPLED``), in one batch."""
    asks = [(p, {}) for p in prompts] + list(zip(prompts, SAMPLED))
    reqs = [gen.submit(gen.make_request(p, max_new_tokens=n_new, **opts)) for p, opts in asks]
    while not all(r.done.is_set() for r in reqs):
        gen.step()
    return [r.result() for r in reqs]


@pytest.mark.parametrize("name", ["qwen38-tiny", "glm53-tiny"])
def test_auto_output_equals_plain_decoding_greedy_and_sampled(models, name):
    """The same generator under three cost tables: drafting free (every row drafts, by MTP or
    lookup, whichever expects more), drafting dear (every step drafts nothing), and the policy's own
    timings (every option tried first). Greedy rows and seeded sampled rows (beside each other) emit
    plain decoding's tokens, whatever the drafts and their lengths."""
    model = models[name]
    prompts = [second_turn(model), [5, 17, 200, 33, 8, 91, 4, 250, 11], [300, 2, 77] * 6]
    plain = generate_mixed(Generator(model, max_batch=4, prefix_cache=0), prompts)
    gen = Generator(model, spec_tokens=K, spec_policy="auto", max_batch=4, prefix_cache=0)
    policy = gen.spec_policy
    runs = {}
    for label, table in (("free", costs(1.0, 1.0)), ("dear", costs(1.0, 10.0)), ("timed", None)):
        if table is None:
            policy.shared, policy.table = False, {}
            policy.samples.clear()
        else:
            policy.load(table)
        before = dict(policy.chosen)
        runs[label] = generate_mixed(gen, prompts)
        for p, a in zip(plain, runs[label]):
            assert a.tokens == p.tokens and a.finish_reason == p.finish_reason, label
        runs[label + " options"] = {o: policy.chosen[o] - before[o] for o in policy.options}
    assert len({tuple(p.tokens) for p in plain[:2] + plain[3:]}) == 4        # sampling changed the outputs
    accepted = [sum(a.stats.get("spec", {}).get("mtp", {}).get("accepted", [0])) for a in runs["free"][3:]]
    assert sum(accepted) > 0, accepted                                       # sampled rows accepted drafts too
    free = runs["free options"]                  # drafting off only where no row can draft (its last token)
    assert free["off"] < sum(free.values()) // 4 and free["d3"] > 0, free
    assert runs["dear options"] == {"off": sum(runs["dear options"].values()), "d1": 0, "d2": 0, "d3": 0}
    assert all(n >= MIN_SAMPLES for n in runs["timed options"].values()), runs["timed options"]
    spec = [a.stats.get("spec", {}) for a in runs["free"][:3]]
    tried = {s: sum(sum(x.get(s, {}).get("tried", [0])) for x in spec) for s in ("mtp", "lookup")}
    accepted = sum(sum(x.get("lookup", {}).get("accepted", [0])) for x in spec)
    print(f"{name}: drafting free: drafts reached {tried}, lookup drafts accepted {accepted}; "
          f"timed: {runs['timed options']}")
    assert tried["mtp"] > 0 and tried["lookup"] > 0 and accepted > 0
    assert sum(a.stats["drafted"] for a in runs["free"][:3]) == sum(sum(int(n) * c for n, c in x["lengths"].items())
                                                                 for x in spec)


@pytest.mark.parametrize("name", ["qwen38-tiny", "glm53-tiny"])
def test_auto_constrained_row_equals_plain_greedy(models, name):
    """A json_schema row beside an unconstrained one (the split step, with per-row plans), with the
    masks' time budget as shipped and with none (share 0: a mask not ready at once makes its row
    sit the step out, and a verify position whose mask is not computed in time caps the row)."""
    model = models[name]
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    g = OutputGrammar(G.json_schema(schema, strict=True))

    prompt = second_turn(model)

    def run(gen):
        reqs = [gen.submit(gen.make_request(prompt, max_new_tokens=30, grammar=g)),
                gen.submit(gen.make_request(prompt, max_new_tokens=30))]
        while not all(r.done.is_set() for r in reqs):
            gen.step()
        return [r.tokens for r in reqs]
    # 4 rows: the shape of the test above and of test_constraint's (their programs, the masked ones too)
    plain = run(Generator(model, max_batch=4, prefix_cache=0))
    auto = Generator(model, spec_tokens=K, spec_policy="auto", max_batch=4, prefix_cache=0)
    assert run(auto) == plain
    assert sum(auto.spec_policy.chosen.values()) > 0
    auto.mask_schedule.share = 0.0
    assert run(auto) == plain
