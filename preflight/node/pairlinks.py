"""The pairwise phase's rules for a straggler and a slow link, in one place for both sides: the nodes use them to
find the links to re-measure alone after the rounds (preflight.node.allreduce), the head to judge the matrix
(preflight.collective.pairwise), so the two never disagree. Standard library only: it is shipped to the nodes.

`rates` is {(a, b): gbps} with a < b, node indices (or names) of the links measured."""
import statistics

SLOWER = 4.0  # "several times slower": a row, or a link, this many times below its peers' median
SLOW_LINK_NODES = 4  # a single slow link is judged from this many nodes on (each end then has two other links)


def _median(values):
    return statistics.median(values) if values else None


def stragglers(rates):
    """{node: (its best link, the median of the links between the others)} for every node whose links are all
    SLOWER times below the links between the other nodes."""
    out = {}
    for x in sorted({n for link in rates for n in link}):
        own = [v for (a, b), v in rates.items() if x in (a, b)]
        others = [v for (a, b), v in rates.items() if x not in (a, b)]
        if len(own) >= 2 and others and max(own) * SLOWER < _median(others):
            out[x] = (max(own), _median(others))
    return out


def slow_links(rates, count, slow_nodes=()):
    """[(a, b, gbps, expected)] in the order of (a, b): one link SLOWER times below the median of each end's other
    links (expected: the lower of the two medians), from SLOW_LINK_NODES of `count` nodes on; a link with an end in
    `slow_nodes` (the stragglers: their whole row is slow) is not one."""
    if count < SLOW_LINK_NODES:  # with three nodes each end has one other link: one busy moment would be enough
        return []
    out = []
    for (a, b), v in sorted(rates.items()):
        if a in slow_nodes or b in slow_nodes:
            continue
        ends = [_median([w for (c, d), w in rates.items() if x in (c, d) and (c, d) != (a, b)]) for x in (a, b)]
        if all(e is not None for e in ends) and v * SLOWER < min(ends):
            out.append((a, b, v, min(ends)))
    return out


def still_slow(rates, count, alone):
    """The slow links once the suspects were measured again alone: `rates` are the rounds' figures, `alone`
    {(a, b): gbps} the retests'. A suspect is judged from the rounds (the other links were measured as it was, with
    the other pairs' traffic); one measured again is slow only if its retest is still SLOWER times below its ends'
    other links (its figure is then the retest's), else it was only busy in its round. The nodes measure the most
    suspect first (allreduce._suspects); when every one they measured again was fast alone, the suspects past their
    limit looked slow as those did, in the same busy rounds, and are not slow links either (unmeasured)."""
    suspects = slow_links(rates, count, stragglers(rates))
    confirmed = [(a, b) for a, b, _, expected in suspects if (a, b) in alone and alone[(a, b)] * SLOWER < expected]
    busy = not confirmed and any((a, b) in alone for a, b, _, _ in suspects)
    out = []
    for a, b, v, expected in suspects:
        again = alone.get((a, b))
        if again is None and not busy:
            out.append((a, b, v, expected))
        elif again is not None and again * SLOWER < expected:
            out.append((a, b, again, expected))
    return out


def unmeasured(rates, count, alone):
    """The suspects not measured again that still_slow clears (every one measured again was fast alone)."""
    slow = set((a, b) for a, b, _, _ in still_slow(rates, count, alone))
    return [s for s in slow_links(rates, count, stragglers(rates)) if (s[0], s[1]) not in alone
            and (s[0], s[1]) not in slow]


def most_suspect_first(links):
    """slow_links' links, the slowest against its ends' other links first: the order the nodes measure them
    again in, so that a limit on the retests leaves out the least suspect."""
    return sorted(links, key=lambda link: (link[2] / link[3] if link[3] else 0.0, link[0], link[1]))
