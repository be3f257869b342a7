"""AcceptanceStats: derived fields, merging, and a dict round trip that shares nothing."""

from specdec.stats import AcceptanceStats


def test_merging_stats_read_from_dicts_leaves_the_dicts_alone():
    a = AcceptanceStats(target_forwards=2, drafted_tokens=4, accepted_tokens=3, generated_tokens=5,
                        position_drafted=[2, 2], position_accepted=[2, 1], num_calls=1).to_dict()
    b = AcceptanceStats(target_forwards=1, drafted_tokens=2, accepted_tokens=0, generated_tokens=1,
                        position_drafted=[1, 0], position_accepted=[0, 0], num_calls=1).to_dict()
    for _ in range(2):  # a report merges the same records overall, then per category
        total = AcceptanceStats.from_dict(a).merge(AcceptanceStats.from_dict(b))
        assert total.position_drafted == [3, 2] and total.position_accepted == [2, 1]
    assert a["position_drafted"] == [2, 2]
    assert total.mean_accepted_tokens == 2.0 and total.acceptance_rate == 0.5
    assert total.per_position_acceptance == [2 / 3, 0.5]
