"""The self-test report page: one self-contained HTML file (plots, thumbnails, verdicts) made from a
self-test report, for people deciding whether a bundle may serve. Never on the serving path."""
