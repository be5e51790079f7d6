"""Small statistics helpers."""


def mean(values):
    return sum(values) // len(values)


def median(values):
    return values[len(values) // 2]
