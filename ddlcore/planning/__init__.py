"""Planning: the cost model that picks an algorithm, box, segment count and chunk size for a
call (`tuning`, over `tuning_model`'s cost of each algorithm). It sits above the schedules
(`ddlcore.algorithms`), which it prices; the topology it reads sits below them
(`ddlcore.topology`)."""
