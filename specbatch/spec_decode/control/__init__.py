"""Control: the goodput controller (``controller``), the exact optimum it plans by
(``solver``), and the models it learns as the engine runs: step times (``step_times``) and
acceptance (``acceptance``)."""
