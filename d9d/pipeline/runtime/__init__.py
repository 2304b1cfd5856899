"""Running a program: stage runtimes, P2P channels, the executor."""
