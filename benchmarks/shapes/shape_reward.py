"""A reward for measuring real-size RL steps on a random-init model, which answers nothing right:
a stable pseudo-random score of the response, so the samples of a group differ, advantages are not
zero and every step moves the weights as a learning step of the recipe's learning rate does (Adam's
update size does not depend on what the reward means)."""

import zlib


def score(response: str, row) -> float:
    return (zlib.crc32(response.encode("utf-8")) % 1000) / 1000
