"""ROLL's domain_interleave_probs (--domain-interleave-probs), a feature: each training step's prompts are drawn by
domain, the rows' data_source, with the given probabilities, and each domain's rows come in their own seeded order
(a new one each time its rows are used up), so a small domain repeats while a large one is still being read.
common.data.StepPrompts routes here when the flag is set."""

import torch

from common.errors import UsageError

FLAG = "--domain-interleave-probs"


def read_probs(pairs) -> dict[str, float]:
    """{domain: probability} of NAME=PROBABILITY pairs: each a number in [0, 1], summing to 1, no name twice."""
    probs = {}
    for pair in pairs:
        name, _, value = pair.rpartition("=")
        try:
            p = float(value)
        except ValueError:
            raise UsageError(f"{FLAG} {pair}: {value!r} is not a number; give NAME=PROBABILITY") from None
        if not 0 <= p <= 1 or name in probs:
            raise UsageError(f"{FLAG} {pair}: " + ("named twice" if name in probs else "a probability is in [0, 1]"))
        probs[name] = p
    if abs(sum(probs.values()) - 1) > 1e-6:
        raise UsageError(f"{FLAG}: the probabilities sum to {sum(probs.values()):.6g}, not 1")
    return probs


def check_domains(pairs, rows: list[dict]) -> None:
    """Every named domain is a data_source of the training rows, and every data_source of the rows is named (a
    domain left out would never be trained: give it 0 to mean that)."""
    probs, present = read_probs(pairs), sorted({row["data_source"] for row in rows})
    unknown, unnamed = sorted(set(probs) - set(present)), sorted(set(present) - set(probs))
    if unknown:
        raise UsageError(f"{FLAG}: no training row has data_source {unknown[0]!r}; the rows have {present}")
    if unnamed:
        raise UsageError(
            f"{FLAG}: data_source {unnamed[0]!r} of the training rows has no probability; add {unnamed[0]}=P"
        )


class DomainSampler:
    """The row indices of every step: step s draws each of its batch_size places' domain from its own seeded
    generator, and a domain's k-th draw in the run takes the (k mod n)-th row of its order for pass k // n over its
    n rows. A pure function of the step (the draws of the steps before it are counted once, then kept), so a
    resumed run, or an engine sampling ahead, reads what an uninterrupted run reads."""

    def __init__(self, rows: list[dict], pairs, batch_size: int, seed: int, shuffle: bool):
        probs = read_probs(pairs)
        self.names = sorted(probs)
        self.weights = torch.tensor([probs[name] for name in self.names], dtype=torch.float64)
        self.members = [[i for i, row in enumerate(rows) if row["data_source"] == name] for name in self.names]
        self.n, self.batch_size, self.seed, self.shuffle = len(rows), batch_size, seed, shuffle
        self.used = [torch.zeros(len(self.names), dtype=torch.long)]  # draws of each domain before step s
        self.orders = {}  # (domain, pass) -> its order; one pass or two of each domain at a time

    def _draws(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.multinomial(self.weights, self.batch_size, replacement=True, generator=g)

    def _order(self, domain: int, epoch: int) -> list[int]:
        members = self.members[domain]
        if not self.shuffle:
            return members
        if (domain, epoch) not in self.orders:
            self.orders.pop((domain, epoch - 2), None)
            g = torch.Generator().manual_seed((self.seed * 100_003 + epoch) * 1_009 + domain)
            self.orders[domain, epoch] = [members[i] for i in torch.randperm(len(members), generator=g).tolist()]
        return self.orders[domain, epoch]

    def indices(self, step: int) -> tuple[int, list[int]]:
        """(epoch over all the rows, the step's row indices)."""
        while len(self.used) <= step:
            self.used.append(self.used[-1] + torch.bincount(self._draws(len(self.used) - 1), minlength=len(self.names)))
        seen, out = self.used[step].clone(), []
        for d in self._draws(step).tolist():
            epoch, j = divmod(int(seen[d]), len(self.members[d]))
            out.append(self._order(d, epoch)[j])
            seen[d] += 1
        return step * self.batch_size // self.n, out
