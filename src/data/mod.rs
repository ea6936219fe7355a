pub mod loader;
pub mod mnist;
pub mod synthetic;
pub mod table;

mod cache;
pub(crate) use cache::checksum;
mod criteo;
mod tsv;

pub use criteo::{CRITEO_DENSE, CRITEO_SPARSE};
pub use table::{load, parse_data_arg, DataSource, Examples, LoadOptions, LoadReport, TsvSchema};
