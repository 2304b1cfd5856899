"""Pipeline parallelism: stage protocol, schedules compiled into per-rank programs, executor, simulator."""
