"""A real torch worker: @record writes TORCHELASTIC_ERROR_FILE, then the error propagates (exit 1)."""

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    raise ValueError("boom 42")


if __name__ == "__main__":
    main()
