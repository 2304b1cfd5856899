"""The coordinator's parts, each usable without Ray except the worker group: what an attempt ended with
(`outcome`), whether to try again (`failure`), how big to run (`scaling`), what clients asked for
(`mailbox`), where metric points go (`metrics`), when a running attempt is declared failed (`health`),
the ranks of one attempt (`workers`), and the loop over attempts (`controller`)."""
