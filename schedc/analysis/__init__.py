"""What a schedule costs, predicted and measured: the cost model, the simulator, hidden and
exposed communication, the trace format, and the cost model fitted to traces. No torch."""
