"""Planning: the topology (who shares a host, the box dimensions, each level's link) and the cost
model that picks an algorithm, box, segment count and chunk size for a call. The schedules
themselves are built by `ddlcore.algorithms`."""
