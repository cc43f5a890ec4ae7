"""Lab tools around `slipstream bench` (server/bench/): peer servers, reports, plots and the server-side
request trace used by the side-by-side comparisons; not installed by the wheel."""
