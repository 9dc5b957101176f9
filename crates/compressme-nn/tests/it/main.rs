//! Integration tests for compressme-nn (one binary, topic modules).
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)] // tests

mod bert;
mod decoders;
mod embedding;
mod layers;
mod model;
mod real_checkpoint;
mod real_decoder;
