"""kvforge.runtime.drivers: the step engine and what drives it: the loaded export, the Generator, the Scheduler and their pieces."""
