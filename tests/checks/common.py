"""What the layout checks share: the eight sequences they train on, and how two gradients are compared."""

from collections.abc import Callable

import torch

from fsdptrain.data.dataset import Sample


def two_groups(values: Callable[[torch.Generator, int, int, torch.Tensor], dict[str, torch.Tensor]]) -> list[Sample]:
    """Eight sequences, two prompts' groups of four, the same on every layout, each with its sequence index and
    response token count, plus the token values that `values(generator, prompt length, response length, loss
    mask)` draws for it."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        if i % 4 == 0:
            prompt = torch.randint(3, 1000, (int(torch.randint(3, 9, (), generator=g)),), generator=g)
        response = int(torch.randint(2, 12, (), generator=g))
        ids = torch.cat([prompt, torch.randint(3, 1000, (response,), generator=g)])
        mask = torch.cat([torch.zeros(len(prompt), dtype=torch.long), (torch.rand(response, generator=g) < 0.9).long()])
        length = len(ids)
        samples.append(Sample(ids, mask, {**values(g, len(prompt), response, mask), "sequence": torch.full((length,), float(i)),
                                          "sequence_tokens": torch.full((length,), float(mask[1:].sum()))}, shared_prefix=len(prompt)))
    return samples


def relative_gap(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The norm of the difference of two gradients (by parameter name) over the norm of `expected`, which must
    not be zero."""
    difference = sum(float((got[name] - grad).square().sum()) for name, grad in expected.items()) ** 0.5
    size = sum(float(grad.square().sum()) for grad in expected.values()) ** 0.5
    assert size > 0
    return difference / size
