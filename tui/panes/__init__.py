"""The dashboard's tabs. Each renders from ``DashboardState`` and never calls the server."""
