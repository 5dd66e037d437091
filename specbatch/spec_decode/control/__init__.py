"""Control: the goodput controller (``controller``) and the models it learns as the engine runs,
step times (``step_times``) and acceptance (``acceptance``)."""
