"A stand-in for `capbook.book.run_step` whose process dies, as a worker killed for memory does (test_book)."
import os


def run_step(*args, **kwargs):
    os._exit(137)
