//! stub being written
