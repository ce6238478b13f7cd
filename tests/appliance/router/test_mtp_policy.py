"""The MTP verify policy (appliance/router/mtp_policy.py): a fixed limit, or the cost rule from
the worker's measured verify-over-paused step times and the accept length seen, with probes."""

from __future__ import annotations

from appliance.router.mtp_policy import PROBE_EVERY, VerifyPolicy

COSTS = {1: 1.1, 2: 1.15, 4: 1.3, 8: 1.6, 16: 2.4}


def test_a_fixed_limit_counts_decoding_requests_only():
    policy = VerifyPolicy(limit=3, costs=COSTS)  # a limit given wins over the costs
    assert [policy.verify(n) for n in (1, 3, 4, 40)] == [True, True, False, False]
    policy.observe(4, 0)  # acceptance does not matter
    assert policy.verify(2)
    assert "more than 3" in policy.describe()


def test_no_limit_and_no_costs_always_verifies():
    policy = VerifyPolicy()
    assert all(policy.verify(n) for n in (1, 64, 1000))
    assert policy.describe() == "every step verifies drafts"


def test_the_cost_rule_weighs_the_accept_length_against_the_batch_cost():
    policy = VerifyPolicy(costs=COSTS)
    assert policy.verify(16) and not policy.verify(17)  # unmeasured: verify within the graphs
    assert policy.cost(3) == 1.3 and policy.cost(9) == 2.4 and policy.cost(17) is None
    policy.observe(4, 8)  # accept length 3.0
    assert policy.accept_len == 3.0
    assert all(policy.verify(n) for n in (1, 5, 16))
    for _ in range(20):
        policy.observe(8, 4)  # 1.5 per step: the running mean falls toward it
    assert 1.5 <= policy.accept_len < 1.6
    assert policy.verify(4) and not policy.verify(8) and not policy.verify(16)
    assert "16: 2.40" in policy.describe()


def test_paused_steps_probe_with_a_verify_now_and_then():
    policy = VerifyPolicy(costs=COSTS)
    policy.observe(2, 0)  # accept length 1: nothing pays
    decisions = []
    for _ in range(3 * PROBE_EVERY):
        decisions.append(policy.verify(8))
        assert policy.verify(8) == decisions[-1]  # asking again changes nothing
        policy.planned(decisions[-1])
    assert decisions.count(True) == 3 and decisions[PROBE_EVERY - 1]
    policy.observe(8, 24)  # the probe saw full acceptance (1 + 3): 1 + 0.2 * 3 = 1.6
    assert policy.accept_len == 1.6 and policy.verify(8)
