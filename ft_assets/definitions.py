"""Assembles the Dagster definitions of all four planes; the work lives in the plane modules."""

import dagster as dg

from ft_assets.console import ft_console
from ft_assets.control import assets as control_assets
from ft_assets.control.automation import deliver_after_training, train_after_data, training_window
from ft_assets.control.jobs import PLANE_JOBS
from ft_assets.control.sensors import dataset_version_sensor
from ft_assets.control.rented_workers import RentedWorkersResource
from ft_assets.control.shutdown import Ec2WorkersResource, idle_gpu_worker_sensor
from ft_assets.data import assets as data_assets
from ft_assets.data import checks as data_checks
from ft_assets.data.resources import DataExecutorResource
from ft_assets.delivery import assets as delivery_assets
from ft_assets.delivery import checks as delivery_checks
from ft_assets.resources import ArtifactRefIOManager, ObjectStoreResource
from ft_assets.training import assets as training_assets


def make_definitions(
    data_executor: DataExecutorResource | None = None, rented_workers: RentedWorkersResource | None = None
) -> dg.Definitions:
    """The project's definitions; ``data_executor`` replaces the data plane's executor, e.g. one with a
    dagster-ray resource that creates a cluster for the run (docs/guides/data.md);
    ``rented_workers`` the providers the idle sensor watches beside EC2 (docs/deploy/idle-shutdown.md)."""
    store = ObjectStoreResource()
    return dg.Definitions(
        assets=dg.load_assets_from_modules([control_assets, data_assets, training_assets, delivery_assets]),
        asset_checks=dg.load_asset_checks_from_modules([data_checks, delivery_checks]),
        jobs=PLANE_JOBS,
        sensors=[dataset_version_sensor, train_after_data, deliver_after_training, idle_gpu_worker_sensor],
        schedules=[training_window],
        resources={
            "store": store,
            "refs": ArtifactRefIOManager(store=store),
            "data_executor": data_executor or DataExecutorResource(),
            "ec2_workers": Ec2WorkersResource(),
            "rented_workers": rented_workers or RentedWorkersResource(),
        },
        loggers={"ft_console": ft_console},
    )


defs = make_definitions()
